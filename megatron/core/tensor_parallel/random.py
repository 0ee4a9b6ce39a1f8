"""Random-number streams for dropout under tensor parallelism, and recomputation.

Two streams exist on every rank:
- the default stream (torch's global generator), seeded identically on all tp ranks
  of a pipeline stage, so dropout on replicated activations agrees across tp;
- the tensor-parallel stream, seeded with an offset per tp rank, so dropout on
  sharded activations (attention probabilities of different heads, sequence
  shards under sequence parallelism) differs across tp ranks.

`RNGTracker.fork()` swaps the tensor-parallel stream into the global generator
for the duration of a block. `checkpoint()` recomputes a function in backward
with both streams restored to their forward-time states, so dropout masks replay
identically.
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint

TENSOR_PARALLEL_SEED_OFFSET = 2718


def derive_seed(seed: int, pp_rank: int) -> int:
    """Seed of the default stream: same across tp and dp ranks, different per pipeline stage."""
    return seed + 100 * pp_rank


class RNGTracker:
    """Holds the tensor-parallel generator state for one device type."""

    def __init__(self, device: torch.device, seed: int, tp_rank: int):
        self.device = torch.device(device)
        self._state = self._seeded_state(seed + TENSOR_PARALLEL_SEED_OFFSET + tp_rank)

    def _get_global(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set_global(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def _seeded_state(self, seed: int) -> torch.Tensor:
        saved = self._get_global()
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        state = self._get_global()
        self._set_global(saved)
        return state

    @contextlib.contextmanager
    def fork(self):
        """Run the block on the tensor-parallel stream, then return to the default stream."""
        saved = self._get_global()
        self._set_global(self._state)
        try:
            yield
        finally:
            self._state = self._get_global()
            self._set_global(saved)

    def get_state(self) -> torch.Tensor:
        return self._state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state.clone()


def checkpoint(function, tracker: RNGTracker | None, *args):
    """Activation checkpointing that also replays the tensor-parallel stream.

    torch's checkpoint restores the global generator for the recomputation; the
    tracker's state is captured here and restored around the recomputation too.
    """
    if tracker is None:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)
    forward_state = tracker.get_state()
    calls = {"n": 0}

    def replaying(*inner):
        calls["n"] += 1
        if calls["n"] == 1:
            return function(*inner)
        after_forward = tracker.get_state()
        tracker.set_state(forward_state)
        try:
            return function(*inner)
        finally:
            tracker.set_state(after_forward)

    return torch.utils.checkpoint.checkpoint(replaying, *args, use_reentrant=False, preserve_rng_state=True)
