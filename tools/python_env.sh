# Sourced by the install, test and example scripts: sets PYTHON to the interpreter to use.
#   1. an active virtual environment or conda environment: its python;
#   2. else a python3 that already imports torch (a GPU image's own torch is never replaced);
#   3. else ./.venv in the checkout, created on first use (system interpreters refuse pip, PEP 668).
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  PYTHON="$VIRTUAL_ENV/bin/python"
elif [ -n "${CONDA_PREFIX:-}" ] && [ -x "$CONDA_PREFIX/bin/python" ]; then
  PYTHON="$CONDA_PREFIX/bin/python"
elif command -v python3 >/dev/null && python3 -c "import torch" 2>/dev/null; then
  PYTHON="$(command -v python3)"
else
  if [ ! -x "$_root/.venv/bin/python" ]; then
    echo "creating a virtual environment in $_root/.venv (reused by later runs)" >&2
    python3 -m venv "$_root/.venv" || {
      echo "error: python3 -m venv failed; install the venv module (Debian/Ubuntu: apt-get install python3-venv)" >&2
      exit 2
    }
  fi
  PYTHON="$_root/.venv/bin/python"
fi
export PYTHON
