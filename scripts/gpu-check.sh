#!/usr/bin/env bash
# The prepared GPU check (pipeline/benchmarks/gpu_check.py): every figure as JSON in OUT_DIR, one file per part plus
# summary.json. On a machine without the packages, --wheels installs a folder of wheels first (scripts/gpu-wheels.sh
# makes it); nothing is fetched.
#
#   scripts/gpu-check.sh OUT_DIR [--device cpu|cuda|auto] [--wheels DIR] [more flags of the check: --steps N, --parts]
#
# Exit status: 0 when every part passed, 1 when some part failed (summary.json says which and why).
set -euo pipefail
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: $0 OUT_DIR [--device cpu|cuda|auto] [--wheels DIR] [--steps N] [--parts a,b]" >&2
  exit 2
fi
out=$1
shift
device=auto
wheels=""
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --wheels) wheels=$2; shift 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
mkdir -p "$out"
if [ -n "$wheels" ]; then
  # A folder of its own, put ahead of the interpreter's site-packages: a carried package that the image also has in
  # another version (transformers) wins, and the image itself is left as it was.
  site=${GPU_CHECK_SITE:-/tmp/sluice-gpu-site}
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ "$device" = cpu ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # steadier timings on a small shared CPU
fi
cd "$root"
check=("$py" -W "ignore::UserWarning" -W "ignore::DeprecationWarning" -W "ignore::FutureWarning"
       -m pipeline.benchmarks.gpu_check --out "$out" --device "$device")
set +e
"${check[@]}" ${extra[@]+"${extra[@]}"}
rc=$?
# A part that kills the process (a fatal CUDA error, the kernel's OOM killer) leaves its name under "running" in
# summary.json: run once more, recording that part as failed and measuring the parts after it.
if [ "$rc" -gt 1 ] && grep -q '"running"' "$out/summary.json" 2>/dev/null; then
  echo "the check died (exit $rc) during a part; resuming after it" >&2
  "${check[@]}" --resume ${extra[@]+"${extra[@]}"}
  rc=$?
fi
exit "$rc"
