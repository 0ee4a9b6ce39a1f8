"""Megatron's NullTokenizer: text is space-separated token ids; for benchmarks and tests."""

from __future__ import annotations


class NullTokenizer:
    """Ids are `0..vocab_size-1`; as in megatron-core, the last one (vocab_size - 1) is EOD."""

    bos = None
    eos = None

    def __init__(self, vocab_size: int):
        if vocab_size < 2:
            raise ValueError(f"--vocab-size must be >= 2 for NullTokenizer, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        try:
            return [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer reads space-separated integers, got {text[:40]!r}") from None

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)
