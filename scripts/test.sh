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
# One pytest worker per core (pytest-xdist), each test file's tests on one worker so that
# its module fixtures are built once. On one worker the suite kept 1.2 of 2 cores busy (most
# tests wait on the processes they start); on two it took 889-1,296 s against 1,254 s on
# 2026-12-04, and 936-1,075 s once OpenMP's threads stopped spinning (tests/conftest.py).
# Files are handed out most tests first (xdist's default): in collection order instead, the
# end-to-end files ran side by side and the suite took 1,170 s; the slow files first, 1,022
# s; the agent examples' file first, 1,049 s. A later `-n` overrides (`-n 0`: no workers).
exec .venv/bin/python -m pytest -n auto --dist loadfile "$@"
