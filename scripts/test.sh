#!/usr/bin/env bash
# Set up (if needed) and run the test suite on CPU. Tests start their own redis-server (AOF, temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python -m ruff check pipeline tests
set +e
# The full learning runs take minutes each; `bash scripts/test.sh -m learning` runs just those.
python -m pytest -q -m "not learning" --durations=25 "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: treating that as a failure" >&2
  exit 1
fi
exit "$rc"
