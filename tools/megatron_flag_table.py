"""Print the Megatron-LM flag compatibility table, generated from the argument parser.

The table lives in docs/megatron-lm.md, between the `<!-- flag-table:start -->` and
`<!-- flag-table:end -->` markers; after changing a flag, paste this script's output there
(tests/unit/test_megatron_scripts.py fails until the guide holds the parser's table):

    python tools/megatron_flag_table.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.arguments.megatron_flags import compatibility_table  # noqa: E402
from megatron.training.arguments.parser import GPT_DEFAULTS, build_parser  # noqa: E402

if __name__ == "__main__":
    print(compatibility_table(build_parser(GPT_DEFAULTS)))
