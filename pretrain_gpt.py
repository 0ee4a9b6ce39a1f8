"""Pre-train a GPT model (GPT-2 defaults: LayerNorm, learned positions, GELU, biases, tied embeddings).

torchrun --nproc-per-node 4 pretrain_gpt.py --num-layers 2 --hidden-size 64 ... --mock-data --vocab-size 256
"""

import sys

from megatron.training.arguments.parser import GPT_DEFAULTS
from megatron.training.pretrain import main

if __name__ == "__main__":
    sys.exit(main(GPT_DEFAULTS, prog="pretrain_gpt.py"))
