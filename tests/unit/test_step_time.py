"""The step-time projection: each term against its formula or the simulator, ranking sanity, and the
calibration against published runs (tools/bench/published_runs.py)."""

import dataclasses

import pytest
import torch

from megatron.core.distributed.model_chunk_buffers import DDPConfig
from megatron.core.optimizer.config import OffloadConfig
from megatron.core.parallel_config import ParallelConfig
from megatron.core.transformer.config import TransformerConfig
from megatron.planning import MemoryLayout
from megatron.planning.comm_volume import (
    cp_bytes_per_layer,
    dp_bytes,
    group_bandwidth,
    p2p_bytes,
    tp_bytes_per_layer,
)
from megatron.planning.compute_cost import (
    Calibration,
    attention_time,
    elementwise_bytes,
    gemm_efficiency,
    gemm_seconds,
    layer_time,
    output_layer_time,
)
from megatron.planning.hardware import DEVICES, Hardware
from megatron.planning.pipeline_simulator import simulate
from megatron.planning.planner import Search, enumerate_layouts, stage_splits
from megatron.planning.step_time import (
    Overlap,
    Practice,
    Projection,
    data_parallel_seconds,
    host_traffic_bytes,
    pipeline_seconds,
    rank_parameters,
    recompute_forward_flops,
    slowest_rank_work,
    step_time,
    transfer_seconds,
)
from tools.bench.planner_calibration import (
    balanced_summary,
    evaluate_all,
    leave_one_source_out,
    print_table,
    summary,
)
from tools.bench.published_runs import ALL_RUNS, MOE_CHECK_RUNS, RUNS

A100 = DEVICES["a100-80gb"]
CAL = Calibration()
# SC21's 1.7B GPT (24 layers, h 2304, 24 heads, seq 2048, vocab 51,200, fp16)
GPT_1_7B = TransformerConfig(
    num_layers=24,
    hidden_size=2304,
    num_attention_heads=24,
    vocab_size=51200,
    seq_length=2048,
    max_position_embeddings=2048,
    params_dtype=torch.float16,
)


def _split(config, tp=1, cp=1, **changes):
    return dataclasses.replace(
        config, tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=tp > 1, **changes
    )


def test_volumes_are_the_ring_formulas():
    assert tp_bytes_per_layer(100, 64, 2, 1) == 0
    assert tp_bytes_per_layer(100, 64, 2, 4) == 4 * 3 / 4 * 100 * 64 * 2  # 2 all-gathers + 2 reduce-scatters
    assert cp_bytes_per_layer(100, 32, 2, 1) == 0
    assert cp_bytes_per_layer(100, 32, 2, 4) == 3 * 2 * 100 * 32 * 2  # K and V passed on cp - 1 times
    assert p2p_bytes(100, 64, 2, 4, True) == 100 * 64 * 2 / 4 and p2p_bytes(100, 64, 2, 4, False) == 100 * 64 * 2
    assert dp_bytes(1000, 1, 4, 2, True) == (0, 0)
    assert dp_bytes(1000, 8, 4, 2, True) == (7 / 8 * 1000 * 4, 7 / 8 * 1000 * 2)  # reduce-scatter, all-gather
    assert dp_bytes(1000, 8, 4, 2, False) == (2 * 7 / 8 * 1000 * 4, 0)  # all-reduce


def test_group_bandwidth_inside_and_across_nodes():
    hw = Hardware(intra_node_gbps=300, inter_node_gbps=25, gpus_per_node=8)
    assert group_bandwidth(hw, 8, 1) == 300e9  # tp 8: NVLink
    assert group_bandwidth(hw, 4, 2) == 300e9  # 4 ranks 2 apart: one node
    assert group_bandwidth(hw, 4, 8) == 25e9  # one rank per node: its own adapter
    assert group_bandwidth(hw, 32, 2) == 4 * 25e9  # 4 ranks per node: 4 adapters
    assert group_bandwidth(hw, 32, 1) == 8 * 25e9 and group_bandwidth(hw, 1, 1) == float("inf")
    assert group_bandwidth(dataclasses.replace(hw, inter_node_gbps=50), 32, 1) == 300e9  # capped by NVLink


def test_model_communication_is_volume_over_bandwidth():
    """tp: forward + backward collectives of every layer of every microbatch; dp: the gradient
    all-reduce (replicated optimizer) with nothing hidden when the overlap is off."""
    config = _split(GPT_1_7B, tp=4)
    layout = MemoryLayout(ParallelConfig(tp=4, dp=4), micro_batch_size=2, num_microbatches=3)
    t = step_time(config, layout, A100, CAL, Overlap(grad_reduce=False))
    per_layer = tp_bytes_per_layer(2 * 2048, 2304, 2, 4) / (300e9 * CAL.comm_efficiency)
    assert t.tp_comm_s == pytest.approx(3 * 24 * 2 * per_layer)
    grad, gather = dp_bytes(rank_parameters(config, layout), 4, 4, 2, False)
    bandwidth = 2 * 25e9 * CAL.comm_efficiency  # 2 dp ranks per node, an adapter each
    assert gather == 0 and t.dp_comm_s == t.dp_comm_total_s == pytest.approx(grad / bandwidth)
    overlapped = step_time(config, layout, A100, CAL, Overlap(grad_reduce=True))
    backward = slowest_rank_work(config, layout, A100, CAL).backward_s
    assert overlapped.dp_comm_s == pytest.approx(max(0.0, t.dp_comm_total_s - backward))


def test_pipeline_time_is_the_simulators():
    """Forward, backward and transfer durations go into our schedule's simulator: its makespan is the
    pipeline part of the step (busy + bubble + exposed transfers), interleaving's transfers included."""
    for p, v, m in ((4, 1, 8), (4, 2, 8), (2, 3, 6)):
        exact = simulate(p, v, m, forward_time=1.0, backward_time=2.5, transfer_time=0.2).makespan
        assert pipeline_seconds(p, v, m, None, 1.0, 2.5, 0.2) == pytest.approx(exact, rel=1e-12)
    config = _split(GPT_1_7B, tp=2)
    layout = MemoryLayout(ParallelConfig(tp=2, pp=4, virtual_stages=2, dp=1), micro_batch_size=1, num_microbatches=8)
    t = step_time(config, layout, A100, CAL)
    work = slowest_rank_work(config, layout, A100, CAL)
    f, b, transfer = work.forward_s / 2, work.backward_s / 2, transfer_seconds(config, layout, A100, CAL)
    assert transfer > 0
    pipeline = t.compute_s + t.tp_comm_s + t.cp_comm_s + t.pp_comm_s + t.bubble_s
    exact = simulate(4, 2, 8, forward_time=f, backward_time=b, transfer_time=transfer).makespan
    assert pipeline == pytest.approx(exact, rel=0.01)  # duration ratios rounded to two digits
    assert t.bubble_s == pytest.approx(
        simulate(4, 2, 8, forward_time=f, backward_time=b).makespan - 16 * (f + b), rel=0.01
    )


@pytest.mark.parametrize("v,transfer", [(1, 0.3), (2, 0.3), (1, 0.0)])
def test_long_pipelines_extrapolate_the_steady_state_exactly(v, transfer):
    m = 40
    exact = simulate(4, v, m, forward_time=1.0, backward_time=2.0, transfer_time=transfer).makespan
    assert pipeline_seconds(4, v, m, None, 1.0, 2.0, transfer) == pytest.approx(exact, rel=1e-12)


def test_recomputation_adds_its_forward():
    layout = MemoryLayout(micro_batch_size=2, num_microbatches=2)
    none = step_time(GPT_1_7B, layout, A100, CAL)
    full_config = dataclasses.replace(
        GPT_1_7B, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    full = step_time(full_config, layout, A100, CAL)
    forward, _ = layer_time(GPT_1_7B, "flash", 2, 1, 1, A100, CAL)
    assert none.recompute_s == 0 and full.recompute_s == pytest.approx(2 * 24 * forward.total)
    assert full.hardware_flops - full.model_flops == pytest.approx(recompute_forward_flops(full_config, 4 * 2048, 24))
    assert full.model_flops == none.model_flops and none.hardware_flops == none.model_flops
    selective = step_time(dataclasses.replace(GPT_1_7B, recompute_granularity="selective"), layout, A100, CAL)
    assert selective.recompute_s == pytest.approx(2 * 24 * forward.attention)


def test_gemm_efficiency_follows_shape_and_device():
    big, thin = (8192, 8192, 8192), (8192, 8192, 256)
    a100, h100 = DEVICES["a100-80gb"], DEVICES["h100-80gb"]
    assert gemm_efficiency(*thin, 2, a100, CAL) < gemm_efficiency(*big, 2, a100, CAL) < CAL.gemm_peak_fraction
    assert gemm_efficiency(*big, 2, h100, CAL) < gemm_efficiency(*big, 2, a100, CAL)  # 295 vs 153 FLOP per byte


def test_attention_and_elementwise_terms():
    """Flash: the causal half of 4 b a s^2 d FLOPs at flash_fraction of peak, backward 2.5x; unfused:
    two GEMMs per head plus the softmax (and dropout) bytes over the scores; elementwise bytes of
    norms and residuals split over tp under sequence parallelism."""
    b, s, a, d = 2, 2048, 24, 96
    forward, backward = attention_time(GPT_1_7B, "flash", b, 1, 1, A100, CAL)
    assert forward.attention == pytest.approx(4 * b * a * s * s * d / 2 / (312e12 * CAL.flash_fraction))
    assert backward.attention == pytest.approx(2.5 * forward.attention)
    gemms = 2 * b * a * gemm_seconds(s, s, d, 2, A100, CAL)
    hbm = 2039e9 * CAL.hbm_efficiency
    no_dropout = dataclasses.replace(GPT_1_7B, attention_dropout=0.0, hidden_dropout=0.0)
    unfused, _ = attention_time(no_dropout, "math", b, 1, 1, A100, CAL)
    assert unfused.attention == pytest.approx(gemms + b * a * s * s * 4 / hbm)  # softmax reads and writes fp16
    dropped, _ = attention_time(GPT_1_7B, "math", b, 1, 1, A100, CAL)
    assert dropped.attention == pytest.approx(gemms + b * a * s * s * (4 + 5) / hbm)  # + dropout in, out, mask
    tokens, h, f = 4096, 2304, 4 * 2304
    plain = elementwise_bytes(no_dropout, tokens, 1)
    assert plain == tokens * (2 * 2 * h * 2 + 2 * 3 * h * 2 + 2 * f * 2)
    sp = elementwise_bytes(
        dataclasses.replace(no_dropout, tensor_model_parallel_size=4, sequence_parallel=True), tokens, 4
    )
    assert sp == pytest.approx(plain / 4)


def test_fused_output_layer_runs_its_three_gemms_in_the_forward():
    """--cross-entropy-loss-fusion: the forward's 3 GEMMs (logits, then the two gradients) and a read per
    logit for the reductions plus a read and a write for the gradient kernel, in fp16, for the unfused
    path's 20 and 12 bytes of fp32 cross-entropy; backward only scales the weight gradient into fp32
    main_grad (12 bytes per weight element)."""
    tokens, vocab = 4096, 51200
    plain_f, plain_b = output_layer_time(GPT_1_7B, vocab, tokens, 2, A100, CAL)
    fused = dataclasses.replace(GPT_1_7B, cross_entropy_loss_fusion=True)
    fused_f, fused_b = output_layer_time(fused, vocab, tokens, 2, A100, CAL)
    assert (fused_f.gemm, fused_b.gemm) == (pytest.approx(plain_f.gemm + plain_b.gemm), 0.0)
    per_logit = plain_f.elementwise / 20
    assert fused_f.elementwise == pytest.approx(6 * per_logit)
    assert fused_b.elementwise == pytest.approx(12 * per_logit * GPT_1_7B.hidden_size / tokens)


def test_sc21_1_7b_never_above_peak():
    """Every layout the planner enumerates for SC21's first row stays below the A100's peak, and
    its parts are non-negative and add up to the step."""
    search = Search(
        cps=(1,),
        micro_batch_sizes=(1, 4, 16),
        recompute=("none", "full"),
        distributed_optimizer=(True,),
        max_virtual_stages=2,
    )
    projection = Projection(hw=A100)
    seen = 0
    for config, layout, _ in enumerate_layouts(GPT_1_7B, 32, 512, search, A100):
        t = projection(config, layout)
        assert 0 < t.model_tflops_per_gpu <= t.hardware_tflops_per_gpu < A100.peak_tflops
        assert min(t.breakdown().values()) >= 0 and t.total_s == pytest.approx(
            sum(t.breakdown().values()) - t.dp_comm_total_s
        )
        seen += 1
    assert seen > 20


def test_more_tensor_parallelism_costs_communication():
    """At 8 GPUs, each doubling of tp (dp halving) adds tensor-parallel time and the total rises;
    a tp group that leaves the node pays the network."""
    times = []
    for tp in (1, 2, 4, 8):
        layout = MemoryLayout(
            ParallelConfig(tp=tp, dp=8 // tp), micro_batch_size=4, num_microbatches=32 // (8 // tp) // 4
        )
        times.append(step_time(_split(GPT_1_7B, tp=tp), layout, A100, CAL))
    assert [t.tp_comm_s for t in times] == sorted(t.tp_comm_s for t in times) and times[0].tp_comm_s == 0
    assert [t.total_s for t in times] == sorted(t.total_s for t in times)
    layout = MemoryLayout(ParallelConfig(tp=8, dp=1), micro_batch_size=4, num_microbatches=8)
    small_nodes = step_time(_split(GPT_1_7B, tp=8), layout, dataclasses.replace(A100, gpus_per_node=4), CAL)
    nvlink = step_time(_split(GPT_1_7B, tp=8), layout, A100, CAL).tp_comm_s
    assert small_nodes.tp_comm_s == pytest.approx(3 * nvlink)  # 4 adapters x 25 GB/s instead of 300 GB/s


def test_uneven_stages_are_candidates_and_relieve_the_last_stage():
    assert stage_splits(126, 16) == [(7, 7)]  # Llama 3
    assert (None, None) in stage_splits(32, 4) and (7, 7) in stage_splits(32, 4)
    search = Search(
        tps=(1,), cps=(1,), pps=(4,), micro_batch_sizes=(1,), recompute=("none",), distributed_optimizer=(True,)
    )
    splits = {
        (lay.parallel.first_stage_layers, lay.parallel.last_stage_layers)
        for _, lay, _ in enumerate_layouts(dataclasses.replace(GPT_1_7B, num_layers=30), 4, 8, search, A100)
    }
    assert (None, None) not in splits and splits  # 30 layers on 4 stages: only uneven splits
    big_vocab = dataclasses.replace(GPT_1_7B, num_layers=8, vocab_size=256000)
    even = MemoryLayout(ParallelConfig(pp=2), num_microbatches=8)
    lighter_last = dataclasses.replace(
        even, parallel=dataclasses.replace(even.parallel, first_stage_layers=5, last_stage_layers=3)
    )
    assert step_time(big_vocab, lighter_last, A100, CAL).total_s < step_time(big_vocab, even, A100, CAL).total_s


def test_data_parallel_group_spans_nodes():
    layout = MemoryLayout(
        ParallelConfig(tp=8, dp=4, ddp=DDPConfig(use_distributed_optimizer=True)),
        micro_batch_size=1,
        num_microbatches=1,
    )
    grad, gather = data_parallel_seconds(_split(GPT_1_7B, tp=8), layout, A100, CAL)
    assert grad == pytest.approx(2 * gather)  # fp32 gradients, fp16 parameters, one adapter each


def test_practice_of_other_frameworks():
    """Context parallelism by all-gather: the K/V bytes of the ring, none hidden behind attention;
    parameters gathered again before every microbatch's forward: m gathers of the same bytes, each
    hidden behind the microbatch forward it feeds, gradients still reduce-scattered once."""
    config = dataclasses.replace(_split(GPT_1_7B, tp=2), params_dtype=torch.bfloat16)
    layout = MemoryLayout(
        ParallelConfig(tp=2, cp=2, dp=8, ddp=DDPConfig(use_distributed_optimizer=True)),
        micro_batch_size=1,
        num_microbatches=4,
    )
    overlap = Overlap(grad_reduce=True, param_gather=True)
    ring = step_time(config, layout, A100, CAL, overlap)
    gathered = step_time(config, layout, A100, CAL, overlap, practice=Practice(cp_all_gather=True))
    per_layer = cp_bytes_per_layer(1024, 2304 // 2, 2, 2) / (group_bandwidth(A100, 2, 2) * CAL.comm_efficiency)
    assert ring.cp_comm_s == 0 and gathered.cp_comm_s == pytest.approx(4 * 24 * 3 * per_layer)
    again = step_time(config, layout, A100, CAL, overlap, practice=Practice(regather_params=True))
    grad, gather = data_parallel_seconds(config, layout, A100, CAL)
    assert data_parallel_seconds(config, layout, A100, CAL, regather_params=True) == pytest.approx((grad, 4 * gather))
    work = slowest_rank_work(config, layout, A100, CAL)
    exposed = max(0.0, grad - work.backward_s) + 4 * max(0.0, gather - work.forward_s)
    assert again.dp_comm_s == pytest.approx(exposed)
    assert again.dp_comm_total_s == pytest.approx(grad + 4 * gather)


def test_calibration_against_published_runs():
    """With the constants fitted on all 50 published runs (5 sources, docs/planner.md): every row of the
    calibration set (SC21, Megatron-Core: measured max 12.2%, mean 5.9%) within 15% and their mean
    below 8%; over all 50 rows the mean below 5% and the worst below 13% (measured 3.9% and 12.2%:
    Megatron-Core's 177B; 4.7% and 15.5%, Llama 3 405B at 8K on 8,192 GPUs, before its parameter
    gathers per microbatch and exposed context-parallel all-gather); no
    calibration-set layout dropped by the memory estimate on its device (two of NVIDIA's DGX Cloud
    layouts are: docs/planner.md). Not here: the two MoE rows added to check r0 (projected about 21% slow,
    tests/unit/test_moe_step_time.py)."""
    outcomes = evaluate_all(runs=[run for run in ALL_RUNS if run not in MOE_CHECK_RUNS])
    print_table(outcomes)
    calibration = [o for o in outcomes if o.run in RUNS]
    mean, worst = summary(outcomes)
    print(f"mean |error| {100 * mean:.1f}%, max {100 * worst:.1f}%")
    assert len(calibration) == len(RUNS)
    assert all(abs(o.error) < 0.15 for o in calibration), [(o.run.name, round(o.error, 3)) for o in calibration]
    assert summary(calibration)[0] < 0.08
    assert mean < 0.05 and worst < 0.13, [(o.run.name, round(o.error, 3)) for o in outcomes if abs(o.error) > 0.1]
    assert all(o.fits and o.certain_fits for o in calibration), [o.run.name for o in calibration if not o.fits]


def test_leave_one_source_out_predicts_each_source_from_the_others():
    """Each fold holds out one source's rows and fits on the rest (no pass here: the start
    constants); the by-source mean counts every source once, however many rows it has."""
    runs = [RUNS[0], RUNS[1], ALL_RUNS[len(RUNS)]]  # two SC21 rows, one of Korthikanti et al.
    folds = leave_one_source_out(runs, start=CAL, passes=0)
    assert [source for source, _, _ in folds] == [RUNS[0].source, ALL_RUNS[len(RUNS)].source]
    assert [[o.run for o in outcomes] for _, _, outcomes in folds] == [runs[:2], runs[2:]]
    assert all(fitted == CAL for _, fitted, _ in folds)
    every = [o for _, _, outcomes in folds for o in outcomes]
    by_source = (summary(folds[0][2])[0] + summary(folds[1][2])[0]) / 2
    assert balanced_summary(every) == pytest.approx((by_source, summary(every)[1]))
    only = leave_one_source_out(runs, start=CAL, passes=0, held_out=("Korthikanti",))  # --held-out
    assert [(source, [o.run for o in outcomes]) for source, _, outcomes in only] == [(runs[2].source, runs[2:])]


def test_host_traffic_of_host_resident_chunks():
    """Offloaded optimizer state moves its gradient down and its weights up once a step; a host
    gradient shard receives every microbatch's reduce-scattered gradient; a host parameter shard
    goes up at every gather (2 per microbatch without PP)."""
    config = dataclasses.replace(GPT_1_7B, params_dtype=torch.bfloat16)
    layout = MemoryLayout(
        ParallelConfig(dp=2, ddp=DDPConfig(sharding_strategy="optim_grads_params")),
        num_microbatches=4,
        offload=OffloadConfig(enabled=True, fraction=1.0),
    )
    shard = rank_parameters(config, layout) / 2
    assert host_traffic_bytes(config, layout) == (4 * shard, 2 * shard)
    resident = dataclasses.replace(layout, offload=OffloadConfig(enabled=True, grad_fraction=1.0, param_fraction=1.0))
    assert host_traffic_bytes(config, resident) == (4 * 4 * shard, 2 * 8 * shard)
    assert host_traffic_bytes(config, dataclasses.replace(layout, offload=OffloadConfig())) == (0.0, 0.0)
    slow = Hardware(host_link_gbps=1.0)
    assert step_time(config, resident, slow).host_s > 0 == step_time(config, layout).host_s
