#!/usr/bin/env bash
# The main job: set up on first use, then `polyrl train` (offline tiny model, synthetic task).
# Extra arguments go to `polyrl train`, e.g. scripts/train.sh trainer.total_steps=50
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/polyrl train "$@"
