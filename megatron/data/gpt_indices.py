"""The three index arrays behind a GPTDataset, built exactly as megatron-core builds them.

Documents (here: the sequences of an indexed dataset) of a split are repeated for as
many epochs as the requested sample count needs and shuffled (the document index). The
shuffled documents are read as one token stream; sample k is the seq_length + 1 tokens
starting at stream position k * seq_length, so consecutive samples share one token: the
last label of sample k is the first input of sample k + 1 (the sample index stores each
start as (position in the document index, offset in that document)). Samples are then
visited in a shuffled order (the shuffle index).

When the last epoch is only partly used (< 80 % of its samples), megatron-core shuffles it
apart from the others ("separate final epoch"), so the used part of it is still a uniform
draw over its documents. All draws come from one numpy RandomState(seed), in the order
document index, then shuffle index, which fixes sample k for a given seed, split and
sequence length. megatron-core walks the stream in C++; here the same positions are found
with a cumulative sum and a binary search.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


@dataclass(frozen=True)
class EpochPlan:
    num_epochs: int
    separate_final_epoch: bool
    samples_before_final_epoch: int  # shuffled apart from the final epoch's samples when separate


def plan_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int | None) -> EpochPlan:
    """Epochs needed for `num_samples` samples (one epoch when None) and whether the last is separate."""
    if tokens_per_epoch <= 0:
        raise ValueError("no tokens to draw samples from")
    if num_samples is None:
        return EpochPlan(1, False, 0)
    needed = num_samples * seq_length + 1
    num_epochs = max(1, -(-needed // tokens_per_epoch))
    if num_epochs == 1:
        return EpochPlan(1, False, 0)
    before = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    from_final = num_samples - before
    assert 0 <= from_final <= per_epoch + 1
    separate = from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    return EpochPlan(num_epochs, separate, before)


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """`documents` repeated num_epochs times and shuffled (the last epoch on its own when separate)."""
    if separate_final_epoch and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate((first, last))
    index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int, num_epochs: int, tokens_per_epoch: int
) -> np.ndarray:
    """[num_samples + 1, 2]: row k is (position in document_index, token offset) of stream
    position k * seq_length; sample k spans rows k and k + 1 (plus the shared token).
    Partial last samples are dropped, as megatron-core does by default."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    lengths = np.asarray(sequence_lengths)[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    docs = np.searchsorted(ends, positions, side="right")
    offsets = positions - (ends[docs] - lengths[docs])
    # megatron-core starts at (0, 0) even when the first documents are empty
    docs[0], offsets[0] = 0, 0
    largest = max(len(document_index), int(np.max(sequence_lengths, initial=0)))
    dtype = np.int32 if largest <= np.iinfo(np.int32).max else np.int64
    return np.stack((docs, offsets), axis=1).astype(dtype)


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, total_size) that keeps [0, num_samples) and the rest apart."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(
    sequence_lengths: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int | None, seed: int
) -> dict[str, np.ndarray]:
    """document_index, sample_index and shuffle_index of one GPTDataset."""
    tokens_per_epoch = int(np.sum(np.asarray(sequence_lengths)[documents], dtype=np.int64))
    plan = plan_epochs(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, plan.num_epochs, rng, plan.separate_final_epoch)
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length, plan.num_epochs, tokens_per_epoch)
    total = len(sample_index) - 1
    first = plan.samples_before_final_epoch if plan.separate_final_epoch else total
    shuffle_index = build_shuffle_index(first, total, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}
