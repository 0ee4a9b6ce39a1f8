#!/usr/bin/env bash
# Install what the framework needs without ever replacing an installed torch.
# Usage: bash tools/install_deps.sh [test]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch" 2>/dev/null; then
  # A CPU build; GPU users install their own torch before running this.
  pip install -q torch==2.13.0
fi
python -c "import triton" 2>/dev/null || pip install -q "triton==3.9.*" || echo "triton not installed: kernels fall back to torch"
pip install -q --no-build-isolation -e . 2>/dev/null || pip install -q -e .
if [ "${1:-}" = "test" ]; then
  pip install -q pytest matplotlib
fi
