#!/usr/bin/env bash
# Install what the framework needs without ever replacing an installed torch.
# Usage: bash tools/install_deps.sh [test]   (the interpreter is chosen by tools/python_env.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/python_env.sh
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  # A CPU build; GPU users install their own torch before running this.
  "$PYTHON" -m pip install -q torch==2.13.0
fi
"$PYTHON" -m pip install -q --no-build-isolation -e . 2>/dev/null || "$PYTHON" -m pip install -q -e .
if [ "${1:-}" = "test" ]; then
  # transformers and tokenizers are independent oracles for the model and the BPE tokenizer
  "$PYTHON" -m pip install -q pytest ruff==0.17.6 matplotlib transformers tokenizers safetensors
  # megatron-core in its own environment, the oracle of tests/mcore_oracle (they skip, saying why, without it)
  bash tools/install_megatron_core.sh >/dev/null || echo "warning: megatron-core could not be installed; its tests will skip" >&2
fi
