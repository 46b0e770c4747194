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
  # The atropos and ray extras (tests/test_atropos*.py, tests/test_ray_fleet.py):
  # atroposlib lists transformers, fastapi, numpy... without bounds, so they are installed
  # under constraints that keep the versions just resolved for polyrl (pip could otherwise
  # move them to ones we never tested).
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
  .venv/bin/pip install -q --disable-pip-version-check -c "$constraints" -e '.[test,atropos,ray]'
  echo "$want" > "$stamp"
fi
# The operator page's browser test (tests/test_operator_view.py) needs a Chromium: Debian's,
# where we may install it; elsewhere the test skips (or set POLYRL_CHROMIUM to a binary).
has_chromium() { [ -n "${POLYRL_CHROMIUM:-}" ] || command -v chromium || command -v chromium-browser || command -v google-chrome; }
if ! has_chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing chromium (apt-get) for the operator page's browser test..." >&2
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }; } \
    || echo "could not install chromium: the browser tests will skip" >&2
fi
# The TLS tests make throwaway certificates with openssl's command line (tests/conftest.py).
if ! command -v openssl >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing openssl (apt-get) for the TLS tests' certificates..." >&2
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -qq openssl >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq openssl >/dev/null 2>&1; }; } \
    || echo "could not install openssl: the TLS tests will skip" >&2
fi
