"""Megatron's load-balanced split of a sequence across context-parallel ranks.

Under causal attention query i attends to i + 1 keys, so a contiguous split gives the last
rank almost all the work. Instead the sequence is cut into 2c equal chunks and cp rank i
holds chunks i and 2c-1-i: every rank then has one early and one late chunk and the same
number of visible (query, key) pairs. A rank's local sequence is its two chunks concatenated.
"""

from __future__ import annotations

import torch


def check_divisible(seq_length: int, cp_size: int) -> None:
    if cp_size < 1 or seq_length % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_length} must be divisible by 2 x context-parallel size "
            f"{cp_size} = {2 * cp_size} (each cp rank holds two equal chunks)"
        )


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of 2c) that cp rank `cp_rank` holds, in local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of a full-sequence tensor (tokens, labels, a loss mask: [b, s, ...] by default)."""
    check_divisible(x.shape[dim], cp_size)
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp_rank, cp_size)], dim=dim)


def positions(seq_length: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions of this rank's tokens, for rotary angles or learned position embeddings."""
    return shard(torch.arange(seq_length, device=device), cp_rank, cp_size, dim=0)


def unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every rank's shard, given in cp rank order."""
    cp_size = len(shards)
    chunks = [None] * (2 * cp_size)
    for rank, part in enumerate(shards):
        for chunk, piece in zip(chunk_ids(rank, cp_size), part.chunk(2, dim=dim)):
            chunks[chunk] = piece
    return torch.cat(chunks, dim=dim)


def causal_pairs(query_positions: torch.Tensor) -> int:
    """Visible (query, key) pairs of causal attention for queries at these global positions:
    the attention work of a rank, since query p sees keys 0..p."""
    return int((query_positions + 1).sum())
