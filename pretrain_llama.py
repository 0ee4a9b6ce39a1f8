"""Pre-train a Llama model (RMSNorm, rotary positions, SwiGLU, no biases, untied output layer, GQA allowed).

torchrun --nproc-per-node 4 pretrain_llama.py --num-layers 2 --hidden-size 64 ... --mock-data --vocab-size 256
"""

import sys

from megatron.training.arguments.parser import LLAMA_DEFAULTS
from megatron.training.pretrain import main

if __name__ == "__main__":
    sys.exit(main(LLAMA_DEFAULTS, prog="pretrain_llama.py"))
