#!/usr/bin/env bash
# Install what the tests need (never replacing an installed torch) and run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh test
source tools/python_env.sh
# The kernel tests must run, never skip: refuse a run where triton is missing.
"$PYTHON" -c "import triton" || { echo "error: triton is not importable; the kernel tests cannot run" >&2; exit 1; }
export OMP_NUM_THREADS=1 TRITON_INTERPRET=1
"$PYTHON" -m pytest tests -q "$@"
