"""Print the README's Megatron-LM flag compatibility table, generated from the argument parser."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.arguments.megatron_flags import compatibility_table  # noqa: E402
from megatron.training.arguments.parser import GPT_DEFAULTS, build_parser  # noqa: E402

if __name__ == "__main__":
    print(compatibility_table(build_parser(GPT_DEFAULTS)))
