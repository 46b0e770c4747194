#!/usr/bin/env bash
# The test suite: set up on first use, then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Bytecode for the sources, once: every worker, manager and trainer the tests start imports
# them, and where Python writes no bytecode itself (PYTHONDONTWRITEBYTECODE, a read-only
# tree) each of those processes compiled polyrl again (~0.2 s of CPU a worker). Up to date,
# this takes a tenth of a second; it is never a reason to fail.
.venv/bin/python -m compileall -q src tests chaos_harness >/dev/null 2>&1 || true
exec .venv/bin/python -m pytest "$@"
