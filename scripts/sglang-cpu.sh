#!/usr/bin/env bash
# Build a CPU-only SGLang 0.5.23 environment for sluice's real-server tests and soak harness.
#
# This is a test fixture, not part of the `pipeline` package. SGLang does not start on a plain
# x86_64 CPU as shipped (there is no CPU build of sgl_kernel on PyPI), so this script installs it
# beside the CPU torch wheel and applies small patches to the installed packages:
#   - torchvision: register its two fake ops only when its compiled ops loaded;
#   - sgl_kernel: a stand-in package (tests/fixtures/sglang_cpu/sgl_kernel) with the one kernel the
#     CPU path calls, in plain torch;
#   - sglang: pin host memory for routed experts only when CUDA is available;
#   - sglang FP8: block-FP8 layers run on the stand-in's torch FP8 kernels, and keep weight_scale_inv's weight
#     loader after loading (SGLang's CPU branch drops it, failing every later weight update);
#   - torch: pinned host memory is a no-op without an accelerator (SGLang's LoRA layers ask for it everywhere),
#     through a module the environment's site-packages imports at start (tests/fixtures/sglang_cpu).
#
# Usage: bash scripts/sglang-cpu.sh            (env in ${SLUICE_SGLANG_ENV:-$HOME/.cache/sluice/sglang-cpu-0.5.23})
# Re-running on a finished env does nothing; delete the env folder to rebuild it.
# Then name <env>/bin/sglang-cpu-python as the interpreter of a managed SGLang (engine.python).
set -euo pipefail

ENV_DIR="${SLUICE_SGLANG_ENV:-$HOME/.cache/sluice/sglang-cpu-0.5.23}"
BASE_PYTHON="${SLUICE_SGLANG_BASE_PYTHON:-python3.11}"
MARKER="$ENV_DIR/.sluice-sglang-cpu-complete"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FIXTURE="$REPO/tests/fixtures/sglang_cpu"

# Bumped whenever the fixture's patches change: an environment built with older ones is brought up to date.
FIXTURE_REV=3
if [ -f "$MARKER" ] && grep -q "fixture $FIXTURE_REV " "$MARKER"; then
    echo "sglang-cpu: $ENV_DIR is already complete ($(cat "$MARKER")); nothing to do"
    exit 0
fi

start=$(date +%s)
echo "sglang-cpu: building $ENV_DIR"
mkdir -p "$(dirname "$ENV_DIR")"
if [ ! -x "$ENV_DIR/bin/python" ]; then
    "$BASE_PYTHON" -m venv "$ENV_DIR"
fi
PY="$ENV_DIR/bin/python"
pip_install() { "$PY" -m pip install --progress-bar off "$@"; }

# 1. The CPU torch wheel first, then sglang itself without its (CUDA) dependency pins.
pip_install torch==2.13.0
pip_install --no-deps sglang==0.5.23

# 2. sglang's runtime dependencies, kept from replacing the CPU torch.
CONSTRAINTS="$ENV_DIR/sluice-constraints.txt"
echo "torch==2.13.0+cpu" > "$CONSTRAINTS"
pip_install -c "$CONSTRAINTS" \
    numpy aiohttp blobfile==3.0.0 einops fastapi interegular msgspec orjson packaging \
    partial_json_parser pillow "prometheus-client>=0.20.0" psutil pybase64 pydantic \
    python-multipart "pyzmq>=25.1.2" regex requests scipy sentencepiece==0.2.1 setproctitle \
    tiktoken tokenizers==0.23.2 transformers==5.19.0 "uvicorn>=0.51" uvloop watchfiles xxhash \
    zstandard safetensors tqdm easydict distro openai==2.8.0 openai-harmony==0.0.4 gguf \
    "python-dateutil<3" triton==3.8.0 IPython dill apache-tvm-ffi==0.1.11 \
    compressed-tensors==0.18.0 xgrammar==0.2.7 "llguidance>=1.7.6,<2" outlines==0.1.11 \
    "mistral_common>=1.11.5" anthropic torch_memory_saver "smg-grpc-servicer>=0.9.0" datasets \
    soundfile==0.13.1 sglang-router
pip_install --no-deps torchvision==0.28.0

# 3. Patches to the installed packages, and the sgl_kernel stand-in (fails loudly on unknown text).
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$PY" "$FIXTURE/patch_env.py" "$SITE"
rm -rf "$SITE/sgl_kernel"
cp -r "$FIXTURE/sgl_kernel" "$SITE/sgl_kernel"
find "$SITE/sgl_kernel" -name '__pycache__' -prune -exec rm -rf {} +
cp "$FIXTURE/sluice_cpu_pinned.py" "$SITE/sluice_cpu_pinned.py"
echo "import sluice_cpu_pinned" > "$SITE/sluice-cpu-pinned.pth"

# 4. The interpreter a user names as engine.python.
WRAPPER="$ENV_DIR/bin/sglang-cpu-python"
cat > "$WRAPPER" <<WRAP
#!/usr/bin/env bash
# Python of the CPU SGLang env built by sluice's scripts/sglang-cpu.sh.
export SGLANG_USE_CPU_ENGINE=1
exec "$PY" "\$@"
WRAP
chmod +x "$WRAPPER"

# 5. A smoke check: the patched modules import, the stand-in kernel works.
"$WRAPPER" - <<'CHECK'
import torch, torchvision, sgl_kernel
import sglang.launch_server  # noqa: F401
req_to_token = torch.zeros((2, 8), dtype=torch.int32)
sgl_kernel.assign_req_to_token_pool_cpu(
    torch.tensor([1]), req_to_token, torch.tensor([2]), torch.tensor([5]),
    torch.tensor([7, 8, 9], dtype=torch.int32), req_to_token.shape[1])
assert req_to_token[1, 2:5].tolist() == [7, 8, 9], req_to_token
assert torch.tensor([1], pin_memory=True).tolist() == [1] and torch.zeros(2).pin_memory().shape == (2,)
print("sglang-cpu: smoke check passed (torch", torch.__version__, ")")
CHECK

echo "sglang 0.5.23 torch 2.13.0+cpu fixture $FIXTURE_REV built $(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$MARKER"
end=$(date +%s)
echo "sglang-cpu: done in $((end - start)) s; env size $(du -sh "$ENV_DIR" | cut -f1)"
echo "sglang-cpu: interpreter for engine.python: $WRAPPER"
