#!/usr/bin/env bash
# Install what the tests need (never replacing an installed torch) and run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh test
export OMP_NUM_THREADS=1 TRITON_INTERPRET=1
python -m pytest tests -q "$@"
