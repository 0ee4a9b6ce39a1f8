"""Dropout streams: derived in one place from (seed, pipeline stage, cp rank, tp rank), they
differ wherever the tokens or shards differ and agree wherever Megatron's agree."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.random import RNGTracker


def mask(tensor_parallel: bool, *, seed=3, pp_rank=0, pp=2, chunk=0, cp_rank=0, tp_rank=0) -> torch.Tensor:
    """The first dropout mask drawn by one model chunk's stream (dp rank plays no part)."""
    tracker = RNGTracker("cpu", seed, stage=chunk * pp + pp_rank, cp_rank=cp_rank, tp_rank=tp_rank)
    with tracker.fork(tensor_parallel=tensor_parallel):
        return F.dropout(torch.ones(256), 0.5)


def test_both_streams_differ_across_pipeline_stages_virtual_chunks_and_cp_ranks():
    for tensor_parallel in (False, True):
        base = mask(tensor_parallel)
        for other in (dict(pp_rank=1), dict(chunk=1), dict(cp_rank=1), dict(seed=4)):
            assert not torch.equal(base, mask(tensor_parallel, **other)), (tensor_parallel, other)


def test_tensor_parallel_stream_differs_across_tp_ranks_replicated_stream_agrees():
    assert not torch.equal(mask(True, tp_rank=0), mask(True, tp_rank=1))
    assert torch.equal(mask(False, tp_rank=0), mask(False, tp_rank=1))
    assert not torch.equal(mask(False), mask(True)), "the two streams of one chunk are distinct"


def test_streams_are_reproducible_and_leave_the_global_generator_alone():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert torch.equal(mask(True, tp_rank=1, cp_rank=1), mask(True, tp_rank=1, cp_rank=1))
    assert torch.equal(torch.get_rng_state(), before)
