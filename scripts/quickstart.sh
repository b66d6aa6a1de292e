#!/usr/bin/env bash
# From a bare machine to a running job: set up, then run the CPU demo into runs/quickstart.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
sluice demo --run-dir runs/quickstart "$@"
