"""Megatron's NullTokenizer: text is space-separated token ids; for benchmarks and tests."""

from __future__ import annotations


class NullTokenizer:
    """`--vocab-size V` names V ordinary ids `0..V-1`; EOD is one more id, V, so the vocabulary has V + 1.

    As Megatron-LM's NullTokenizer, so its checkpoints' vocabulary rows (before padding) and the EOD
    that --eod-mask-loss and --reset-* look for are the same.
    """

    bos = None
    eos = None

    def __init__(self, vocab_size: int):
        if vocab_size < 2:
            raise ValueError(f"--vocab-size must be >= 2 for NullTokenizer, got {vocab_size}")
        self.vocab_size = vocab_size + 1
        self.eod = vocab_size

    def tokenize(self, text: str) -> list[int]:
        try:
            return [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer reads space-separated integers, got {text[:40]!r}") from None

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)
