"""Activation and p2p-buffer peaks over our own pipeline schedules."""

import pytest

from megatron.core.pipeline_parallel.schedules import build_schedule
from megatron.planning.inflight import _rank_profiles, equivalent_microbatches, peaks, profiles, rank_profiles
from megatron.planning.pipeline_simulator import peak_in_flight

GRID = [(p, v, m) for p in (2, 3, 4) for v in (1, 2, 3) for m in (p, 2 * p, 3 * p + (1 if v == 1 else 0))]


@pytest.mark.parametrize("p,v,m", GRID)
def test_peak_microbatches_match_the_simulator(p, v, m):
    for rank in range(p):
        steps = build_schedule(p, v, m, rank)
        states = profiles(steps, v, 0 if rank == 0 else None, v - 1 if rank == p - 1 else None)
        assert peaks(states, [1] * v, 0).peak_microbatches == peak_in_flight(steps)
        assert peaks(states, [1] * v, 0).activations_bytes == peak_in_flight(steps)


def test_one_f_one_b_first_rank_by_hand():
    """p=2, m=4, rank 0: F0 [SF0] F1 [SF1 RB0] B0 ... two microbatches alive, and at the batched
    transfer the unsent output of mb 1 and the received gradient of mb 0 (2 buffers)."""
    steps = build_schedule(2, 1, 4, 0)
    result = peaks(profiles(steps, 1, 0, None), [10], 1)
    assert (result.activations_bytes, result.peak_with_p2p_bytes, result.p2p_extra_bytes) == (20, 22, 2)


def test_last_rank_holds_one_microbatch():
    steps = build_schedule(4, 1, 8, 3)
    result = peaks(profiles(steps, 1, None, 0), [10], 1)
    assert result.peak_microbatches == 1
    assert result.activations_bytes == 10


def test_unequal_chunks_are_weighted_exactly():
    """Interleaved rank 0 holds more chunk-0 (embedding) microbatches than chunk-1 ones at its peak:
    the weighted peak is below count x largest chunk."""
    p, v, m = 2, 2, 4
    states = rank_profiles(p, v, m, 0, None)
    heavy_first = peaks(states, [100, 1], 0)
    count = peaks(states, [1, 1], 0).peak_microbatches
    assert heavy_first.activations_bytes < count * 100
    assert heavy_first.activations_bytes == max(c[0] * 100 + c[1] for c, _ in states)


@pytest.mark.parametrize(
    "p,v,kind",
    [(2, 1, "auto"), (4, 1, "auto"), (2, 2, "auto"), (3, 3, "auto"), (4, 2, "auto")]
    + [(2, 2, "zbv"), (3, 2, "zbv"), (4, 2, "zbv")],
)
def test_long_schedules_visit_the_same_states(p, v, kind):
    """`equivalent_microbatches` is exact: more microbatches repeat the steady state."""
    for m in (5 * p, 6 * p, 7 * p + (2 if v == 1 else 0)):
        short = equivalent_microbatches(p, m, None)
        assert short < m
        for rank in range(p):
            assert _rank_profiles(p, v, m, rank, None, kind) == _rank_profiles(p, v, short, rank, None, kind)


def test_explicit_group_size_is_not_shortened():
    assert equivalent_microbatches(2, 40, 4) == 40
    assert equivalent_microbatches(2, 6, None) == 6
