#!/usr/bin/env bash
# From a bare machine to a learning run: set up .venv, then run the CPU recipe (a tiny Qwen3-MoE written locally,
# the CPU engine, a producer, the Megatron-core trainer with R3, archiver and evaluator) into runs/cpu-moe.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
sluice run recipes/cpu-moe.toml "$@"
