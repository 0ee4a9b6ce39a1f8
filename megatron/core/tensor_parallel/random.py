"""Random-number streams for dropout, and recomputation that replays them.

Each model chunk (one pipeline stage's slice of layers) owns an `RNGTracker`
holding two dropout streams, both derived in `dropout_seeds` from
(seed, global pipeline stage, cp rank) and, for the second, the tp rank:
- the replicated stream: the same on every tp rank, so dropout on activations
  that every tp rank holds in full agrees across tp;
- the tensor-parallel stream: different per tp rank, for dropout on sharded
  activations (attention probabilities of different heads, sequence shards under
  sequence parallelism).
Both differ per pipeline stage (so stage 0's masks are not reused by stage 1,
layer for layer), per virtual chunk (they are different stages) and per cp rank
(different tokens); both agree across dp ranks, as Megatron's do.

`RNGTracker.fork(tensor_parallel)` swaps one stream into torch's global generator
for the duration of a block. `recompute()` reruns a function in backward with the
streams restored to their forward-time states, so dropout masks replay exactly.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.utils.checkpoint


def _seed_from(*parts) -> int:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def dropout_seeds(seed: int, *, stage: int, cp_rank: int, tp_rank: int) -> tuple[int, int]:
    """(replicated stream seed, tensor-parallel stream seed) of global pipeline stage `stage`
    (pipeline_parallel.placement gives each chunk's stage). The only place dropout seeds come from."""
    return _seed_from("dropout", seed, stage, cp_rank), _seed_from("dropout-tp", seed, stage, cp_rank, tp_rank)


class RNGTracker:
    """The two dropout streams of one model chunk on one device type."""

    def __init__(self, device, seed: int, *, stage: int = 0, cp_rank: int = 0, tp_rank: int = 0):
        self.device = torch.device(device)
        replicated, tensor_parallel = dropout_seeds(seed, stage=stage, cp_rank=cp_rank, tp_rank=tp_rank)
        self._states = {False: self._seeded_state(replicated), True: self._seeded_state(tensor_parallel)}

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
    def fork(self, tensor_parallel: bool):
        """Run the block on the tensor-parallel stream (True) or the replicated one (False)."""
        saved = self._get_global()
        self._set_global(self._states[tensor_parallel])
        try:
            yield
        finally:
            self._states[tensor_parallel] = self._get_global()
            self._set_global(saved)

    def get_state(self) -> dict:
        return {key: state.clone() for key, state in self._states.items()}

    def set_state(self, states: dict) -> None:
        self._states = {key: state.clone() for key, state in states.items()}


def recompute(function, tracker: RNGTracker | None, *args):
    """Activation recomputation: drop `function`'s intermediate activations and rerun it in
    backward, replaying the tracker's dropout streams (torch restores its global generator;
    the tracker's states are captured here and restored around the rerun)."""
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
