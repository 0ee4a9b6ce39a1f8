"""Our NullTokenizer has megatron-core's vocabulary size and EOD id for the same --vocab-size."""

from __future__ import annotations

import json
import subprocess

import pytest

from megatron.data.tokenizers import build_tokenizer
from tests.mcore_oracle.oracle import megatron_core_python

MEGATRON_NULL_TOKENIZER = """
import json, sys
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
sizes = json.loads(sys.argv[1])
print(json.dumps([[NullTokenizer(v).vocab_size, NullTokenizer(v).eod] for v in sizes]))
"""


@pytest.mark.parametrize("sizes", [[2, 50, 1858, 50257]])
def test_null_tokenizer_vocabulary_and_eod_equal_megatron_cores(sizes, tmp_path):
    proc = subprocess.run(
        [megatron_core_python(), "-c", MEGATRON_NULL_TOKENIZER, json.dumps(sizes)],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,  # not the checkout, whose own `megatron` package would shadow megatron-core's
    )
    theirs = json.loads(proc.stdout)
    ours = [[tok.vocab_size, tok.eod] for tok in (build_tokenizer("NullTokenizer", vocab_size=v) for v in sizes)]
    assert ours == theirs
