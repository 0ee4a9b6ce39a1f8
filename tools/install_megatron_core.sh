#!/usr/bin/env bash
# megatron-core in its own virtual environment (.venv-mcore/), an oracle for the tests: it installs
# as the package `megatron`, like ours, so the two never share an interpreter. torch is not
# installed again: a path file points at the main interpreter's torch (path files are not
# processed recursively, so our editable install stays invisible there).
# Usage: bash tools/install_megatron_core.sh   (idempotent; prints the environment's python)
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/python_env.sh
VENV="$PWD/.venv-mcore"
VERSION=0.16.1
# megatron-core's `megatron` must be the one imported there (a non-editable install of ours beside torch would shadow it)
check() { "$VENV/bin/python" -I -c "import megatron.core, torch, numpy, psutil
assert megatron.core.__version__ == '$VERSION' and megatron.core.__file__.startswith('$VENV/')" 2>/dev/null; }
if [ -x "$VENV/bin/python" ] && check; then echo "$VENV/bin/python"; exit 0; fi
"$PYTHON" -m venv "$VENV"
site="$("$VENV/bin/python" -I -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
torch_site="$("$PYTHON" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
echo "$torch_site" > "$site/main_torch.pth"
"$VENV/bin/python" -m pip install -q --no-deps "megatron-core==$VERSION"
"$VENV/bin/python" -I -c "import numpy, psutil" 2>/dev/null || "$VENV/bin/python" -m pip install -q numpy psutil
check || { echo "error: megatron-core $VERSION does not import from $VENV (is another package named megatron installed beside torch?)" >&2; exit 1; }
echo "$VENV/bin/python"
