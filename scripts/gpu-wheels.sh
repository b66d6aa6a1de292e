#!/usr/bin/env bash
# Wheels of what the GPU machines' image lacks for scripts/gpu-check.sh, for CPython 3.12 on x86-64 Linux, at the
# versions of this checkout's .venv (the versions CI tests), into one folder that the device tool carries.
#
#   scripts/gpu-wheels.sh [DIR]          DIR defaults to build/gpu-wheels (ignored by git, so it travels only when
#                                        a run names it in carry)
#
# Each wheel is downloaded from the package index for the target interpreter. Where that fails (no network), a
# pure-Python package is repacked from the .venv's own files instead; megatron-core too, without its one compiled
# module (megatron/core/datasets/helpers_cpp, which the trainer never imports). pydantic-core is compiled through and
# through: a cp312 build of it cannot be made offline, and the check needs it (every sluice config is a pydantic
# model), so the script then stops and says so.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/build/gpu-wheels}
py=${PYTHON:-$root/.venv/bin/python}
target=${GPU_PYTHON_VERSION:-3.12}
# What the image lacks (megatron-core, pydantic and its parts), or has too old: transformers 5.17 there predates the
# `cache=` argument the CPU engine passes; transformers 5.25 needs huggingface-hub 2, which imports httpx2 (and it
# httpcore2 and truststore); pydantic 2.14 needs typing-extensions 4.16. Found by running the check in a venv of the
# image's versions (transformers 5.17, huggingface-hub 1.33, typing-extensions 4.15, no pydantic or megatron).
packages=(megatron-core pydantic pydantic-core annotated-types typing-inspection typing-extensions transformers
          huggingface-hub httpx2 httpcore2 truststore)
rm -rf "$dir"
mkdir -p "$dir"
for name in "${packages[@]}"; do
  version=$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  if "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$target" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
      -d "$dir" "$name==$version" 2>/dev/null; then
    continue
  fi
  echo "$name $version: no wheel for CPython $target from the index; repacking the .venv's copy" >&2
  "$py" - "$name" "$dir" <<'EOF'
"""Repack an installed distribution as a py3-none-any wheel from the files its RECORD lists."""
import base64
import hashlib
import importlib.metadata as md
import sys
import zipfile
from pathlib import Path

name, out = sys.argv[1], Path(sys.argv[2])
dist = md.distribution(name)
files = [f for f in dist.files or [] if not str(f).endswith((".pyc", "RECORD", "INSTALLER", "REQUESTED"))
         and "__pycache__" not in str(f) and not str(f).startswith("..")]
compiled = [str(f) for f in files if str(f).endswith(".so")]
if compiled and name != "megatron-core":
    sys.exit(f"{name} {dist.version} is a compiled extension ({', '.join(compiled)}): a build for another CPython "
             "cannot be made from this .venv offline; download its wheel on a machine that reaches the index")
files = [f for f in files if not str(f).endswith(".so")]
info = f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}.dist-info"
wheel = out / f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-py3-none-any.whl"
records = []
with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
    for f in files:
        arc = str(f)
        data = Path(dist.locate_file(f)).read_bytes()
        if arc == f"{info}/WHEEL":  # the installed one names the .venv's CPython and platform
            data = b"Wheel-Version: 1.0\nGenerator: sluice-gpu-wheels\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        zf.writestr(arc, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        records.append(f"{arc},sha256={digest},{len(data)}")
    zf.writestr(f"{info}/RECORD", "\n".join(records + [f"{info}/RECORD,,"]) + "\n")
print(f"repacked {wheel.name}")
EOF
done
size=$(du -sm "$dir" | cut -f1)
rel=${dir#"$root"/}
echo "wheels in $rel: $(ls "$dir" | wc -l) files, ${size} MiB (a run carries at most 64 MiB, the checkout included)"
ls "$dir"
cat <<EOF

The device tool's run, for the session that has a GPU (one command, an estimated 3-5 minutes: it has never run on
a GPU; the timeout leaves a 15-minute session time to rerun some parts with --parts):
  command:   set -o pipefail; bash scripts/gpu-check.sh \$OUT --device cuda --wheels $rel 2>&1 | tee \$OUT/gpu-check.log
  carry:     ["$rel"]
  timeout_s: 420
EOF
