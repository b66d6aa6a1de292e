#!/usr/bin/env bash
# Create .venv and install sluice with everything the CPU recipe and the tests need.
# CPU torch goes in first: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==${SLUICE_TORCH_VERSION:-2.13.0}"
fi
python -m pip install -q -e ".[all]"
