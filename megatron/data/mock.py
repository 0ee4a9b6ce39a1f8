"""Deterministic synthetic token sequences with learnable structure.

Sample i is an arithmetic progression modulo the vocabulary: a start token and
a step (1..4) drawn from a generator seeded by (seed, i). The next token is
predictable from the two before it, so the loss visibly falls. Because each
sample depends only on (seed, index), a global batch holds the same samples
whatever the parallel layout.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_STEP = 4


class MockGPTDataset:
    def __init__(self, vocab_size: int, seq_length: int, seed: int):
        if vocab_size < 2:
            raise ValueError(f"--vocab-size must be >= 2 for mock data, got {vocab_size}")
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed

    def __getitem__(self, index: int) -> dict:
        rng = np.random.default_rng((self.seed, index))
        start = int(rng.integers(self.vocab_size))
        step = int(rng.integers(1, MAX_STEP + 1))
        tokens = (start + step * np.arange(self.seq_length + 1)) % self.vocab_size
        tokens = torch.from_numpy(tokens.astype(np.int64))
        return {"tokens": tokens[:-1], "labels": tokens[1:], "loss_mask": torch.ones(self.seq_length)}
