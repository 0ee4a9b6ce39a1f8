#!/usr/bin/env bash
# Install what the tests need (never replacing an installed torch) and run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh test
source tools/python_env.sh
# The kernel tests must run, never skip: refuse a run where triton is missing.
"$PYTHON" -c "import triton" || { echo "error: triton is not importable; the kernel tests cannot run" >&2; exit 1; }
# The formatter and the linter first (configured in pyproject.toml; ruff pinned in install_deps.sh
# because its formatting changes between versions): a style slip fails fast.
"$PYTHON" -m ruff format --check .
"$PYTHON" -m ruff check .
export OMP_NUM_THREADS=1 TRITON_INTERPRET=1
"$PYTHON" -m pytest tests -q --durations=25 "$@"
