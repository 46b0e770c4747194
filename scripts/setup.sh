#!/usr/bin/env bash
# Idempotent set-up: a virtualenv in .venv with torch (CPU build) and polyrl installed.
# Re-runs pip only when pyproject.toml changed since the last successful set-up.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "polyrl needs Python 3.11+" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.polyrl-setup
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setting up .venv (first run takes a minute or two)..." >&2
  # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
  .venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/pip install -q --disable-pip-version-check "torch==${POLYRL_TORCH_VERSION:-2.13.0}"
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
  # The atropos extra (tests/test_atropos*.py): atroposlib lists transformers, fastapi,
  # numpy... without bounds, so it is installed under constraints that keep the versions
  # just resolved for polyrl (pip could otherwise move them to ones we never tested).
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  .venv/bin/python - > "$constraints" <<'EOF'
from importlib.metadata import PackageNotFoundError, version
for name in ("torch", "transformers", "tokenizers", "fastapi", "pydantic", "numpy"):
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass
EOF
  .venv/bin/pip install -q --disable-pip-version-check -c "$constraints" -e '.[test,atropos]'
  echo "$want" > "$stamp"
fi
