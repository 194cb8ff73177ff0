#!/usr/bin/env bash
# Runs the CPU test suite (GPU tests skip themselves without CUDA). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
exec "$VENV/bin/python" -m pytest -q "$@"
