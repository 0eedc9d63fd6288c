#!/usr/bin/env bash
# Installs the official `openai` Python client, pinned, into a venv for the HTTP API's
# tests (tests/openai/test_api.py).
#
# Usage: tools/ci/install-openai.sh [VENV_DIR]    (default: <repo>/.venv-openai)
# Prints, last, the venv's python. Safe to re-run.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${1:-$repo/.venv-openai}"
python="${PYTHON:-python3}"

if [[ ! -x "$venv/bin/python" ]]; then
  echo "creating venv $venv" >&2
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "openai==3.57.0" >&2
"$venv/bin/python" -c "import openai; assert openai.__version__ == '3.57.0', openai.__version__" >&2
echo "$venv/bin/python"
