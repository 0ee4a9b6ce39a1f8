"""The step-time model and the layout planner."""

import dataclasses

import pytest
import torch

from megatron.core.optimizer.config import OffloadConfig
from megatron.core.parallel_config import ParallelConfig
from megatron.core.transformer.config import TransformerConfig
from megatron.planning import MemoryLayout, estimate_memory
from megatron.planning.bounds import certain_lower_bound
from megatron.planning.hardware import Hardware
from megatron.planning.pipeline_simulator import simulate
from megatron.planning.planner import (
    Search,
    enumerate_layouts,
    offload_needed,
    plan,
    plan_fastest,
    plan_offload,
    smallest_offload,
)
from megatron.planning.step_time import Projection, bubble_units, least_idle, pipeline_idle, step_time
from megatron.planning.transients import CUDA_RUNTIME_BYTES

MODEL = TransformerConfig(
    num_layers=8,
    hidden_size=1024,
    ffn_hidden_size=2816,
    num_attention_heads=16,
    vocab_size=32000,
    seq_length=2048,
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    params_dtype=torch.bfloat16,
)
GIB = 1 << 30


def test_no_schedule_idles_less_than_the_least_idle():
    """What the pruned search's time bound relies on: every simulated schedule idles at least
    (p - 1) x (forward + backward) of one chunk, whatever m (also below p) and the durations."""
    for p, v in ((2, 1), (4, 1), (8, 1), (4, 2), (2, 4), (8, 2)):
        for m in (1, 2, p - 1, p, p + 1, 3 * p):
            if v > 1 and m % p:
                continue
            for backward, transfer in ((1.0, 0.0), (2.0, 0.0), (2.3, 0.1), (3.0, 0.5)):
                idle = pipeline_idle(p, v, m, None, 1.0, backward, transfer)
                assert idle >= least_idle(p, 1.0, backward) - 1e-9, (p, v, m, backward, transfer)


def test_no_zero_bubble_schedule_idles_less_than_its_least_idle():
    """The same for the zero-bubble kinds, with the weight gradients' share of the backward: ZB-H1's
    bound (rank 0's idle, the paper's bubble for m > p) is met with equality at free transfers."""
    for p in (2, 3, 4, 8):
        for m in (1, 2, p - 1, p, p + 1, 2 * p, 3 * p + 1):
            for backward, weight, transfer in ((2.0, 1.0, 0.0), (2.0, 0.8, 0.0), (1.9, 0.76, 0.03), (3.0, 0.5, 0.2)):
                idle = pipeline_idle(p, 1, max(m, 1), None, 1.0, backward, transfer, "zb-h1", weight)
                bound = least_idle(p, 1.0, backward, "zb-h1", weight, max(m, 1))
                assert idle >= bound, (p, m, backward, weight, transfer, idle, bound)
                if m > p and transfer == 0.0 and backward - weight >= weight:
                    assert idle == pytest.approx(bound, abs=1e-6), (p, m, backward, weight)
        for m in (p, 2 * p):
            idle = pipeline_idle(p, 2, m, None, 1.0, 2.0, 0.1, "interleaved-zb", 0.8)
            assert idle >= least_idle(p, 1.0, 2.0, "interleaved-zb", 0.8, m)


@pytest.mark.parametrize("p,v", [(2, 1), (4, 1), (4, 2), (2, 4)])
def test_bubble_is_proportional_and_stops_growing_with_m(p, v):
    """What `bubble_units` relies on: idle time = units x (forward + backward) for any backward/forward
    ratio, and the same for every m >= p (multiples of p for interleaving)."""
    for ratio in (1.5, 2.0, 3.0):
        for m in (p, 3 * p, 6 * p):
            idle = simulate(p, v, m, forward_time=1.0, backward_time=ratio).makespan - v * m * (1 + ratio)
            assert idle == pytest.approx(bubble_units(p, v, 6 * p, None) * (1 + ratio))
    assert bubble_units(p, v, 6 * p, None) == pytest.approx(p - 1)


def test_step_time_components():
    one = step_time(MODEL, MemoryLayout(num_microbatches=8))
    assert (one.tp_comm_s, one.dp_comm_s, one.bubble_s) == (0.0, 0.0, 0.0)
    tp = step_time(
        dataclasses.replace(MODEL, tensor_model_parallel_size=2, sequence_parallel=True),
        MemoryLayout(ParallelConfig(tp=2), num_microbatches=8),
    )
    assert tp.tp_comm_s > 0 and one.compute_s / 2 < tp.compute_s < one.compute_s  # smaller GEMMs, same launches
    pp = step_time(MODEL, MemoryLayout(ParallelConfig(pp=4), num_microbatches=8))
    vpp = step_time(MODEL, MemoryLayout(ParallelConfig(pp=4, virtual_stages=2), num_microbatches=8))
    assert vpp.bubble_s == pytest.approx(pp.bubble_s / 2, rel=0.05)  # p2p time is per chunk, not halved
    full = step_time(
        dataclasses.replace(MODEL, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        MemoryLayout(num_microbatches=8),
    )
    assert full.compute_s > one.compute_s
    dp = step_time(MODEL, MemoryLayout(ParallelConfig(dp=8), num_microbatches=1))
    assert dp.dp_comm_total_s > 0 and dp.dp_comm_s == 0  # hidden behind the backward (--overlap-grad-reduce)


def test_enumeration_is_valid_and_complete():
    layouts = list(enumerate_layouts(MODEL, 8, 32, Search(micro_batch_sizes=(1, 2)), Hardware()))
    assert layouts
    for config, layout, _name in layouts:
        assert layout.parallel.world_size == 8
        assert config.tensor_model_parallel_size == layout.parallel.tp
        assert config.sequence_parallel == (layout.parallel.tp > 1)
        assert 32 % (layout.micro_batch_size * layout.parallel.dp) == 0
        assert config.num_layers % layout.parallel.stages == 0
        assert config.context_parallel_size == layout.parallel.cp
        assert config.seq_length % (2 * layout.parallel.cp * layout.parallel.tp) == 0
    shapes = {(lay.parallel.tp, lay.parallel.cp, lay.parallel.pp, lay.parallel.virtual_stages) for _, lay, _ in layouts}
    assert {(1, 1, 1, 1), (8, 1, 1, 1), (2, 1, 4, 2), (1, 1, 8, 1), (1, 8, 1, 1), (2, 2, 2, 1)} <= shapes
    assert {lay.parallel.ddp.use_distributed_optimizer for _, lay, _ in layouts} == {False, True}


def test_cp_only_where_the_sequence_splits_and_without_attention_dropout():
    search = Search(tps=(1,), pps=(1,), micro_batch_sizes=(1,), recompute=("none",), distributed_optimizer=(False,))
    short = dataclasses.replace(MODEL, seq_length=12)  # 2 x cp chunks: cp 1, 2, 3, 6 divide; 4 does not
    assert sorted(lay.parallel.cp for _, lay, _ in enumerate_layouts(short, 12, 12, search, Hardware())) == [1, 2, 3, 6]
    dropout = dataclasses.replace(MODEL, attention_dropout=0.1)
    assert {lay.parallel.cp for _, lay, _ in enumerate_layouts(dropout, 8, 8, search, Hardware())} == {1}


def test_plan_drops_what_does_not_fit_and_sorts_by_time():
    fitting, rejected, startable = plan(MODEL, 8, 32, 6 * GIB, search=Search(micro_batch_sizes=(1, 2)))
    assert fitting and rejected and 0 <= startable <= rejected
    assert all(c.estimate.max_total_bytes <= 6 * GIB for c in fitting)
    times = [c.time.total_s for c in fitting]
    assert times == sorted(times)
    none, rejected, startable = plan(MODEL, 8, 32, GIB // 100)
    assert none == [] and rejected and startable == 0


def test_plan_counts_dropped_layouts_the_start_up_check_would_start():
    """A layout whose full estimate exceeds the device is dropped from the recommendations, but the
    start-up check starts it while its certain part fits ("fits with margin")."""
    search = Search(
        tps=(8,), cps=(1,), pps=(1,), micro_batch_sizes=(1,), recompute=("none",), distributed_optimizer=(False,)
    )
    (candidate,), _, _ = plan(MODEL, 8, 8, 64 * GIB, search=search)
    estimate = candidate.estimate
    between = (estimate.max_certain_bytes + estimate.max_total_bytes) // 2
    assert estimate.max_certain_bytes < estimate.max_total_bytes
    assert plan(MODEL, 8, 8, between, search=search) == ([], 1, 1)
    assert plan(MODEL, 8, 8, estimate.max_certain_bytes - 1, search=search) == ([], 1, 0)


def test_bounds_hold_for_every_layout():
    """What the pruned search relies on: the parameter count's bound is at most the model states of
    the fullest rank (so above the device it means "does not fit"), and the step time without the
    pipeline's least idle time at most the projection (equal without a pipeline)."""
    projection = Projection()
    search = Search(micro_batch_sizes=(1,), recompute=("full",))
    for cfg, layout, _ in enumerate_layouts(MODEL, 8, 32, search, Hardware()):
        bound = certain_lower_bound(cfg, layout)
        assert 0 < bound <= max(r.states_bytes for r in estimate_memory(cfg, layout).ranks), layout.describe()
        full, lower = projection(cfg, layout).total_s, projection.lower_bound(cfg, layout)
        assert lower <= full and (layout.parallel.pp > 1 or lower == full), layout.describe()


def test_plan_fastest_finds_the_exhaustive_top():
    """On 8 CPU ranks of 2.5 GiB (no allowances, so the parameter count decides early: the replicated
    optimizer at tp 1 x pp 1 holds 2.8 GiB of model states): the same top 5 as estimating every
    layout, in the same order, having pruned some by their parameter count and never estimated
    others (slower by their lower bound); its counts agree with the exhaustive plan's."""
    search = Search(micro_batch_sizes=(1, 2), device_type="cpu")
    device = 5 * GIB // 2
    every, rejected, startable = plan(MODEL, 8, 32, device, search=search)
    top, counts = plan_fastest(MODEL, 8, 32, device, search=search, top=5)
    assert [(c.layout, c.recompute) for c in top] == [(c.layout, c.recompute) for c in every[:5]]
    assert [c.time.total_s for c in top] == [c.time.total_s for c in every[:5]]
    assert counts.considered == len(every) + rejected
    assert counts.pruned > 0 and counts.skipped > 0
    assert counts.estimated + counts.skipped + counts.pruned == counts.considered
    assert counts.fit <= len(every) and counts.margin <= startable
    nothing, none = plan_fastest(MODEL, 8, 32, GIB // 100, search=search)
    assert nothing == [] and none.pruned == none.considered == counts.considered and none.traces == 0


def test_search_restrictions():
    search = Search(
        tps=(2,), cps=(1,), pps=(2,), micro_batch_sizes=(1,), recompute=("none",), distributed_optimizer=(True,)
    )
    layouts = list(enumerate_layouts(MODEL, 8, 32, search, Hardware()))
    assert {
        (lay.parallel.tp, lay.parallel.pp, lay.parallel.dp, lay.parallel.ddp.use_distributed_optimizer, name)
        for _, lay, name in layouts
    } == {(2, 2, 2, True, "none")}
    assert {lay.parallel.virtual_stages for _, lay, _ in layouts} == {1, 2, 4}


ONE = Search(tps=(1,), cps=(1,), pps=(1,), micro_batch_sizes=(1,), recompute=("full",))


def test_plan_offload_proposes_the_smallest_fraction_that_fits():
    """On one device of 4 GiB beside the runtime allowance's 3.86 nothing fits (8 layers of 1024 in bf16:
    1.9 GiB of optimizer state); the offload plan keeps the distributed optimizer and picks the smallest 0.01
    step, from the share that fits by bytes up, whose whole chunks fit."""
    device = 4 * GIB + CUDA_RUNTIME_BYTES - GIB  # 4 GiB when the runtime allowance was 1 GiB
    assert plan(MODEL, 1, 8, device, search=ONE)[0] == []
    (candidate,) = plan_offload(MODEL, 1, 8, device, search=ONE)
    layout, estimate = candidate.layout, candidate.estimate
    assert layout.parallel.ddp.use_distributed_optimizer and 0 < layout.offload_fractions.optimizer < 1
    assert estimate.fits(device) and estimate.ranks[0].host_bytes > 0
    need = offload_needed(
        estimate_memory(candidate.config, dataclasses.replace(layout, offload=OffloadConfig())), device
    )
    assert 0 < need <= layout.offload_fractions.optimizer
    fraction = round(layout.offload_fractions.optimizer - 0.01, 2)
    below = dataclasses.replace(layout, offload=OffloadConfig(enabled=True, fraction=fraction))
    assert below.offload_fractions.optimizer < need or not estimate_memory(candidate.config, below).fits(device)
    assert plan_offload(MODEL, 1, 8, GIB, search=ONE) == []  # weights, gradients and activations alone do not fit


def test_smallest_offload_rounds_up_to_whole_chunks():
    """With few large chunks the fraction that fits by bytes falls short once rounded to whole
    chunks; the proposal is the first 0.01 step whose chunks fit."""
    search = dataclasses.replace(ONE, distributed_optimizer=(True,))
    ((config, layout, _),) = enumerate_layouts(MODEL, 1, 8, search, Hardware())
    layout = layout.with_ddp(bucket_size=40_000_000)
    plain = estimate_memory(config, layout)
    rank = plain.ranks[0]
    device = int(rank.total_bytes - rank.optimizer_bytes / 3)  # needs a third offloaded, by bytes
    need = offload_needed(plain, device)
    assert need == pytest.approx(1 / 3, rel=1e-6)
    estimate = smallest_offload(config, layout, need, device)
    assert estimate.fits(device) and estimate.layout.offload_fractions.optimizer > 0.34


MOE = dataclasses.replace(MODEL, num_layers=4, seq_length=256, num_moe_experts=8, moe_ffn_hidden_size=512)


def test_moe_layouts_search_ep_as_megatron_constrains_it():
    """ep divides the experts and ep x etp the ranks of a stage (etp = tp unless given); the config is split
    as the layout; the parameter count's bound holds with experts split over ep x etp and their optimizer
    state over edp; a given ep restricts the search."""
    search = Search(tps=(1, 2), pps=(1, 2), micro_batch_sizes=(1,), recompute=("none",))
    layouts = list(enumerate_layouts(MOE, 8, 16, search, Hardware()))
    assert {lay.parallel.ep for _, lay, _ in layouts} == {1, 2, 4, 8}
    for cfg, layout, _ in layouts:
        par = layout.parallel
        assert (cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size) == (par.ep, par.tp)
        assert 8 % par.ep == 0 and par.tp * par.cp * par.dp % (par.ep * par.tp) == 0
        bound = certain_lower_bound(cfg, layout)
        assert 0 < bound <= max(r.states_bytes for r in estimate_memory(cfg, layout).ranks), layout.describe()
    given = dataclasses.replace(search, eps=(2,), etps=(1,))
    assert {
        (lay.parallel.ep, lay.parallel.dims.etp) for _, lay, _ in enumerate_layouts(MOE, 8, 16, given, Hardware())
    } == {(2, 1)}


def test_moe_is_planned_by_projected_step_time():
    """MoE layouts are projected (megatron/planning/moe_cost.py) and ranked fastest first."""
    search = Search(tps=(1, 2), pps=(1,), cps=(1,), micro_batch_sizes=(1,), recompute=("none",), eps=(2, 4))
    top, counts = plan_fastest(MOE, 4, 8, 80 * GIB, search=search, top=3)
    assert counts.estimated <= counts.considered - counts.pruned
    times = [c.time.total_s for c in top]
    assert len(top) == 3 and times == sorted(times) and all(c.time.ep_comm_s > 0 for c in top)
