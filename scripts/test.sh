#!/usr/bin/env bash
# Lints, then runs the CPU test suite (GPU tests skip themselves without CUDA). Extra args go
# to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
"$VENV/bin/python" -m ruff check tokenmill tests benchmarks
exec "$VENV/bin/python" -m pytest -q "$@"
