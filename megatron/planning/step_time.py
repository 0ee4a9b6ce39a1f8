"""A performance projection of one training iteration: seconds, tokens/s and TFLOP/s per GPU.

Per microbatch and model chunk, on the pipeline rank with the most work (layers, plus the
output layer on the last rank), the forward F and backward B are the sum of:
computation (megatron/planning/compute_cost.py: GEMMs by shape -- the linear layers' at the
FP8 rate under --fp8-format, but the layers --first-last-layers-bf16 keeps on the ranks holding
them --, attention, elementwise by HBM bytes), recomputation's extra forward (in B), tensor-parallel collectives
(comm_volume.py volumes at the tp group's bandwidth; not overlapped) and the context-
parallel ring (overlapped with the attention it feeds: only what exceeds it counts).
The pipeline is our own schedule run by the simulator with F, B and the p2p transfer
time T: its makespan holds the bubble and the transfers the schedule does not hide
(1F1B exposes two per microbatch; interleaving sends v times as many, mostly hidden);
the zero-bubble schedules split B into input gradients and weight gradients W, taken as
half the backward's matrix products.
Then the data-parallel gradient reduction (and the distributed optimizer's parameter
all-gather): with --overlap-grad-reduce it runs during the last microbatch's backward,
so only what exceeds that backward counts; the parameter all-gather likewise behind the
first forward with --overlap-param-gather. Last the optimizer step, memory-bound.
A published run of another framework may differ where its paper says so (`Practice`): context
parallelism by an all-gather of K and V on the critical path, parameters gathered again before
every microbatch's forward.

Bandwidths are per GPU (hardware.py); a group stays on NVLink while it fits in a node.
The constants are in compute_cost.Calibration, fitted on published runs (docs/planner.md).
MoE layers (moe_cost.py): the attention part of the dense layer, the router, the local experts at the
busiest rank's load, the shared expert and the token dispatch over ep (`ep_comm_s`, not overlapped),
averaged over the model's layers by their share of MoE layers; expert gradients reduce over the
expert-data-parallel group.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, fields

from megatron.core.pipeline_parallel.layer_split import layers_per_rank as layer_counts
from megatron.core.pipeline_parallel.layer_split import rank_layer_counts
from megatron.core.pipeline_parallel.schedules import ZERO_BUBBLE
from megatron.core.transformer.flops import flops_per_iteration
from megatron.planning.comm_volume import (
    cp_bytes_per_layer,
    dp_bytes,
    group_bandwidth,
    p2p_bytes,
    tp_bytes_per_layer,
)
from megatron.planning.compute_cost import Calibration, PassTime, layer_time, output_layer_time
from megatron.planning.hardware import Hardware
from megatron.planning.kernels import dtype_bytes, resolve_kernels
from megatron.planning.makespan import makespan
from megatron.planning.moe_cost import expert_parameters_per_layer, moe_layer_average
from megatron.planning.parameters import padded_vocab, total_parameters

# Adam on fp32 master, m, v: read the gradient and 3 states, write 3 states and the weight, zero the gradient
OPTIMIZER_BYTES_PER_PARAMETER = 38


@dataclass(frozen=True)
class Overlap:
    """Which data-parallel communication runs behind computation (the trainer's flags)."""

    grad_reduce: bool = True  # --overlap-grad-reduce (default on)
    param_gather: bool = False  # --overlap-param-gather (distributed optimizer only)


@dataclass(frozen=True)
class Practice:
    """What a published run of another framework did differently from our trainer (which run, and on
    what evidence: tools/bench/published_runs.py); our own layouts leave both off.

    `cp_all_gather`: context parallelism by an all-gather of K and V before each layer's attention
    (and a reduce-scatter of their gradients after its backward) on the critical path, not our ring
    that overlaps the attention blocks it feeds: the same bytes, none hidden (Llama 3, Section 3.3.2:
    "the all-gather communication latency is exposed in the critical path").
    `regather_params`: the distributed optimizer's parameter all-gather runs before every
    microbatch's forward instead of once a step: parameters kept from a microbatch's forward to its
    backward only (FSDP2's behaviour with `reshard_after_forward=False` under gradient accumulation:
    `reshard_after_backward` stays on), the gradients still accumulated whole and reduce-scattered
    once. Each gather hides behind the microbatch forward it feeds, only what exceeds it counts."""

    cp_all_gather: bool = False
    regather_params: bool = False


DEFAULT_HARDWARE, DEFAULT_CALIBRATION, DEFAULT_OVERLAP = Hardware(), Calibration(), Overlap()
DEFAULT_PRACTICE = Practice()


@dataclass(frozen=True)
class StepTime:
    """One iteration's seconds on the slowest rank, by cause (they add up to `total_s`), and its FLOPs."""

    gemm_s: float
    attention_s: float
    elementwise_s: float
    overhead_s: float
    recompute_s: float
    tp_comm_s: float
    cp_comm_s: float
    ep_comm_s: float  # MoE token dispatch and combine
    pp_comm_s: float
    bubble_s: float
    dp_comm_s: float
    host_s: float  # host-resident chunks' copies over the host link, not hidden by compute
    optimizer_s: float
    step_overhead_s: float
    dp_comm_total_s: float  # the data-parallel communication before overlap (not part of the sum)
    model_flops: float  # per iteration, all GPUs: megatron/core/transformer/flops.py (no recomputation)
    hardware_flops: float  # the same plus the recomputed forward
    tokens: int  # per iteration
    world_size: int

    PARTS = (
        "gemm_s",
        "attention_s",
        "elementwise_s",
        "overhead_s",
        "recompute_s",
        "tp_comm_s",
        "cp_comm_s",
        "ep_comm_s",
        "pp_comm_s",
        "bubble_s",
        "dp_comm_s",
        "host_s",
        "optimizer_s",
        "step_overhead_s",
    )

    @property
    def compute_s(self) -> float:
        return self.gemm_s + self.attention_s + self.elementwise_s + self.overhead_s + self.recompute_s

    @property
    def total_s(self) -> float:
        return sum(getattr(self, name) for name in self.PARTS)

    @property
    def bubble_fraction(self) -> float:
        busy = self.compute_s + self.tp_comm_s + self.cp_comm_s + self.ep_comm_s
        return self.bubble_s / busy if busy else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.model_flops / self.total_s / self.world_size / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        return self.hardware_flops / self.total_s / self.world_size / 1e12

    def breakdown(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name.endswith("_s")}


@dataclass(frozen=True)
class RankWork:
    """One microbatch through all of a pipeline rank's layers (and its output layer on the last rank)."""

    forward: PassTime
    backward: PassTime
    recompute: PassTime
    tp_s: float
    cp_s: float
    ep_s: float
    forward_s: float  # the forward with its communication
    backward_s: float  # the backward, recomputation and their communication


def _two_digits(x: float) -> float:
    return float(f"{x:.2g}")


def bubble_units(p: int, v: int, m: int, group_size: int | None, kind: str = "auto", weight: float = 0.0) -> float:
    """Idle time per rank of our schedule without transfer time, in units of one chunk's forward +
    backward: the simulated makespan minus the busy time, with forward 1 and backward 2 (the idle
    time is proportional to forward + backward: checked in tests/unit/test_memory_planner.py).
    `kind`: the schedule (schedules.KINDS); for the zero-bubble kinds `weight` is the weight
    gradients' share of the backward."""
    return (_unit_makespan(p, v, m, group_size, 2.0, 0.0, kind, _two_digits(2.0 * weight)) - v * m * 3.0) / 3.0


@functools.lru_cache(maxsize=4096)
def _unit_makespan(
    p: int, v: int, m: int, group_size: int | None, backward: float, transfer: float, kind: str, weight: float
) -> float:
    """The schedule's makespan with forward 1 (`weight`: the WEIGHT steps' time, zero-bubble kinds).
    Past 2p microbatches (same m mod p) it grows by the same amount per p more (the steady state
    repeats; checked against full simulations in tests/unit/test_memory_planner.py), so two
    simulations give it for any m."""

    def run(microbatches: int) -> float:
        return makespan(
            p,
            v,
            microbatches,
            kind=kind,
            group_size=group_size,
            forward_time=1.0,
            backward_time=backward,
            transfer_time=transfer,
            weight_time=weight if kind in ZERO_BUBBLE else None,
        )

    base = 2 * p + m % p
    if group_size is not None or m <= base + p:
        return run(m)
    first = run(base)
    return first + (run(base + p) - first) * (m - base) / p


def pipeline_idle(
    p: int,
    v: int,
    m: int,
    group_size: int | None,
    forward: float,
    backward: float,
    transfer: float,
    kind: str = "auto",
    weight: float = 0.0,
) -> float:
    """Idle time per rank of the pipeline schedule with these per-chunk durations: the simulated
    makespan minus the computation. The simulation runs with backward / forward, transfer / forward
    and weight / forward (the weight-gradient part of the backward, zero-bubble kinds) rounded to
    two significant digits, so that planning reuses simulations."""
    if p == 1:
        return 0.0
    ratio_b = _two_digits(backward / forward)
    ratio_t = _two_digits(transfer / forward) if transfer else 0.0
    ratio_w = _two_digits(weight / forward) if kind in ZERO_BUBBLE else 0.0
    makespan = _unit_makespan(p, v, m, group_size, ratio_b, ratio_t, kind, ratio_w)
    return forward * (makespan - v * m * (1.0 + ratio_b))


def least_idle(p: int, forward: float, backward: float, kind: str = "auto", weight: float = 0.0, m: int = 0) -> float:
    """Idle time the pipeline schedule `kind` of p stages has, at least, with these per-chunk
    durations (as `pipeline_idle` rounds them): the first chunk forward reaches the last stage after
    p - 1 others, and, but in the zero-bubble schedules (whose weight-gradient steps fill that
    time), the last backward returns to the first stage after p - 1 others. ZB-H1 (`weight`: the
    weight-gradient part of `backward`; m microbatches) also idles as rank 0 does, which defers no
    weight step: `_zb_h1_rank0_idle`."""
    if kind == "zb-h1":
        ratio_b, ratio_w = _two_digits(backward / forward), _two_digits(weight / forward)
        return forward * max(p - 1.0, _zb_h1_rank0_idle(p, m, ratio_b, ratio_w))
    if kind in ZERO_BUBBLE:
        return (p - 1) * forward
    return (p - 1) * forward * (1.0 + _two_digits(backward / forward))


def _zb_h1_rank0_idle(p: int, m: int, backward: float, weight: float) -> float:
    """Rank 0's idle time under ZB-H1 with forward 1 (`backward` includes `weight`), at least, less a
    relative 1e-9 for the simulation's rounding. Its first backward starts after microbatch 0's
    p forwards and p - 1 input-gradient steps (one after another, stage after stage) and, for m > p,
    the forward of microbatch m-1 ends after m - p of its backwards, weight steps and forwards more;
    from there microbatch m-1 makes p - 1 forwards, p input-gradient steps and rank 0's weight step.
    Less rank 0's work: (p - 1)(1 + backward - 2 weight), ZB-H1's bubble in the paper's terms; for
    m <= p, (p - m) + (p - 1)(backward - weight)."""
    grad = backward - weight
    idle = (p - 1) * (1.0 + grad - weight) if m > p else (p - m) + (p - 1) * grad
    return idle - 1e-9 * m * (1.0 + backward)


def pipeline_seconds(
    p: int, v: int, m: int, group_size: int | None, forward: float, backward: float, transfer: float
) -> float:
    """Makespan of the pipeline schedule with these per-chunk durations."""
    return v * m * (forward + backward) + pipeline_idle(p, v, m, group_size, forward, backward, transfer)


def recompute_forward_flops(config, tokens: int, layers: int) -> float:
    """FLOPs of the forward that recomputation runs again: the attention scores and context
    (selective), or the whole forward of the recomputed layers (full)."""
    s, a, d = config.seq_length, config.num_attention_heads, config.kv_channels
    if config.recompute_granularity == "selective":
        return layers * 4.0 * tokens * s * a * d
    if config.recompute_granularity == "full":
        n = recomputed_layers(config, layers)
        h, g, f = config.hidden_size, config.num_query_groups, config.ffn_hidden_size
        mats = h * (a + 2 * g) * d + a * d * h + (3 if config.swiglu else 2) * h * f
        return n * 2.0 * tokens * (mats + 2 * s * a * d)
    return 0.0


def recomputed_layers(config, layers: int) -> int:
    """How many of a rank's `layers` full recomputation runs forward twice."""
    if config.recompute_granularity != "full":
        return 0
    return layers if config.recompute_method == "uniform" else min(config.recompute_num_layers, layers)


def _recomputed(config, forward: PassTime, layers: int) -> PassTime:
    """What recomputation adds to a rank's backward: the attention core (selective) or the
    forward of the recomputed layers (full)."""
    if config.recompute_granularity == "selective":
        return PassTime(attention=forward.attention).scaled(layers)
    return forward.scaled(recomputed_layers(config, layers))


def slowest_rank_work(
    config, layout, hw: Hardware, cal: Calibration, attention: str = "auto", cp_all_gather: bool = False
) -> RankWork:
    """One microbatch through the pipeline rank with the most work (its layers, and the output layer
    on the last rank: uneven first/last stages move that balance). `cp_all_gather`: the context-
    parallel K/V exchange on the critical path (`Practice`), not hidden behind the attention."""
    tp, cp = layout.parallel.tp, layout.parallel.cp
    element = dtype_bytes(config.params_dtype)
    tokens = layout.micro_batch_size * config.seq_length // cp
    kernel = resolve_kernels(config, layout.device_type, attention).attention
    out_f, out_b = output_layer_time(config, padded_vocab(config, tp), tokens, tp, hw, cal)
    tp_dense = tp_bytes_per_layer(tokens, config.hidden_size, element, tp) / (
        group_bandwidth(hw, tp, 1) * cal.comm_efficiency
    )
    cp_layer = cp_bytes_per_layer(tokens, config.num_query_groups * config.kv_channels // tp, element, cp) / (
        group_bandwidth(hw, cp, tp) * cal.comm_efficiency
    )

    def average_layer(cfg) -> tuple[PassTime, PassTime, float, float]:
        """(forward, backward, tp seconds, dispatch seconds) of the model's average layer under `cfg`."""
        layer = layer_time(cfg, kernel, layout.micro_batch_size, cp, tp, hw, cal)
        if cfg.num_moe_experts is None:
            return *layer, tp_dense, 0.0
        return moe_layer_average(cfg, layout, kernel, layer, tp_dense, hw, cal)

    layer_f, layer_b, tp_layer, ep_layer = average_layer(config)
    bf16_counts = bf16_layer_counts(config, layout.parallel)
    # --first-last-layers-bf16: those layers' GEMMs in the model's precision (the same communication)
    bf16_f, bf16_b = average_layer(dataclasses.replace(config, fp8=None))[:2] if any(bf16_counts) else (None, None)
    cp_f = max(0.0, cp_layer - layer_f.attention)  # the ring hides behind the attention blocks it feeds
    cp_b = max(0.0, 2 * cp_layer - layer_b.attention)
    if cp_all_gather:
        cp_f, cp_b = cp_layer, 2 * cp_layer

    def work(layers: int, last: bool, bf16: int) -> RankWork:
        forward = layer_f.scaled(layers) if not bf16 else layer_f.scaled(layers - bf16) + bf16_f.scaled(bf16)
        backward = layer_b.scaled(layers) if not bf16 else layer_b.scaled(layers - bf16) + bf16_b.scaled(bf16)
        forward += out_f if last else PassTime()
        backward += out_b if last else PassTime()
        recompute = _recomputed(config, layer_f, layers)
        again = recomputed_layers(config, layers)
        tp_fwd, cp_fwd, ep_fwd = tp_layer * layers, cp_f * layers, ep_layer * layers
        tp_bwd, cp_bwd = tp_layer * (layers + again), cp_b * layers + cp_f * again
        ep_bwd = ep_layer * (layers + again)
        return RankWork(
            forward,
            backward,
            recompute,
            tp_fwd + tp_bwd,
            cp_fwd + cp_bwd,
            ep_fwd + ep_bwd,
            forward.total + tp_fwd + cp_fwd + ep_fwd,
            backward.total + recompute.total + tp_bwd + cp_bwd + ep_bwd,
        )

    counts, output_rank = _rank_layers(config, layout.parallel)
    return max(
        (work(n, r == output_rank, bf16_counts[r]) for r, n in enumerate(counts)),
        key=lambda w: w.forward_s + w.backward_s,
    )


def bf16_layer_counts(config, par) -> list[int]:
    """Layers of each pipeline rank kept out of FP8 by --first-last-layers-bf16 (all zero without it)."""
    recipe = config.fp8
    if recipe is None or not recipe.first_last_layers_bf16:
        return [0] * par.pp
    return [
        sum(
            not recipe.layer_in_fp8(i, config.num_layers)
            for chunk in par.layer_ids(config.num_layers, r)
            for i in chunk
        )
        for r in range(par.pp)
    ]


def _rank_layers(config, par) -> tuple[list[int], int]:
    """Layers of each pipeline rank (all its chunks) and the rank holding the output layer: the last
    rank, or rank 0 in the V placement of zbv (which also holds the embedding there)."""
    if par.placement.kind == "v":
        return rank_layer_counts(config.num_layers, par.placement, par.first_stage_layers, par.last_stage_layers), 0
    return layer_counts(config.num_layers, par.pp, par.first_stage_layers, par.last_stage_layers), par.pp - 1


def transfer_seconds(config, layout, hw: Hardware, cal: Calibration) -> float:
    """One pipeline send between neighbouring stages (tp x cp x dp ranks apart)."""
    par = layout.parallel
    if par.pp == 1:
        return 0.0
    tokens = layout.micro_batch_size * config.seq_length // par.cp
    volume = p2p_bytes(tokens, config.hidden_size, dtype_bytes(config.params_dtype), par.tp, config.sequence_parallel)
    return volume / (group_bandwidth(hw, 2, par.tp * par.cp * par.dp) * cal.comm_efficiency)


def rank_parameter_split(config, layout) -> tuple[float, float]:
    """(parameters outside the routed experts, the experts' own) of the pipeline rank holding the most
    (its layers and an embedding or output layer): experts split over ep x etp, the rest over tp."""
    par = layout.parallel
    embedding = padded_vocab(config, par.tp) * config.hidden_size
    embeddings = 2 if config.untie_embeddings_and_output_weights else 1
    experts = expert_parameters_per_layer(config)
    per_layer = (total_parameters(config, par.tp) - embeddings * embedding) / config.num_layers - experts
    counts, _ = _rank_layers(config, par)
    ends = embeddings if par.placement.kind == "v" else 1  # the V's rank 0 holds the embedding and the output layer
    return (max(counts) * per_layer + ends * embedding) / par.tp, max(counts) * experts / (par.ep * par.dims.etp)


def rank_parameters(config, layout) -> float:
    """Parameters of the pipeline rank holding the most (`rank_parameter_split`, both parts)."""
    return sum(rank_parameter_split(config, layout))


def optimizer_shard(config, layout) -> float:
    """Parameters the rank's optimizer steps: the distributed optimizer shards the experts' over the
    expert-data-parallel group, the rest over dp x cp."""
    par = layout.parallel
    dense, experts = rank_parameter_split(config, layout)
    if not par.ddp.use_distributed_optimizer:
        return dense + experts
    return dense / (par.dp * par.cp) + experts / par.dims.edp


def dp_collectives(layout, regather_params: bool = False) -> tuple[int, int]:
    """(gradient reduce-scatters, parameter all-gathers) per step: one each, except that sharded
    gradients (optim_grads, optim_grads_params) are reduce-scattered per microbatch and sharded
    parameters gathered before a microbatch's forward and again before its backward (once a step
    when they stay gathered between them under pipeline parallelism); gradients accumulated
    unsharded are reduce-scattered once per step. `regather_params` (`Practice`): one gather
    before every microbatch's forward."""
    m, ddp = layout.num_microbatches, layout.parallel.ddp
    gathers = 2 * m if ddp.shards_params and ddp.reshard_after_forward else m if regather_params else 1
    return (m if ddp.shards_grads and not ddp.unsharded_grad_accumulation else 1), gathers


def host_traffic_bytes(config, layout) -> tuple[float, float]:
    """(device->host, host->device) bytes per step of one rank's host-resident chunks, from the
    layout's fractions (distributed/placement.py): offloaded optimizer state sends its fp32
    gradient down and its updated weights up once a step (neither when that part is itself on
    host); host gradient shards receive each reduce-scattered gradient (once a step when
    accumulated unsharded); host parameter shards are copied up at every gather."""
    if not layout.offload_fractions.optimizer:
        return 0.0, 0.0
    shard = optimizer_shard(config, layout)
    weight, grad = dtype_bytes(config.params_dtype), layout.parallel.ddp.grad_dtype.itemsize
    reductions, gathers = dp_collectives(layout)
    opt, grads, params = layout.offload_fractions
    down = shard * ((opt - grads) * grad + grads * grad * reductions)
    up = shard * ((opt - params) * weight + params * weight * gathers)
    return down, up


def data_parallel_seconds(
    config, layout, hw: Hardware, cal: Calibration, regather_params: bool = False
) -> tuple[float, float]:
    """(gradient reduction, parameter all-gather) seconds over the dp x cp group (the experts' over the
    expert-data-parallel group, ep x etp ranks apart), before any overlap."""
    par = layout.parallel
    dense, experts = rank_parameter_split(config, layout)
    grad, gather = 0.0, 0.0
    for parameters, ranks, stride in ((dense, par.dp * par.cp, par.tp), (experts, par.dims.edp, par.ep * par.dims.etp)):
        volumes = dp_bytes(
            parameters,
            ranks,
            par.ddp.grad_dtype.itemsize,
            dtype_bytes(config.params_dtype),
            par.ddp.use_distributed_optimizer,
            *dp_collectives(layout, regather_params),
        )
        bandwidth = group_bandwidth(hw, ranks, stride) * cal.comm_efficiency
        grad, gather = grad + volumes[0] / bandwidth, gather + volumes[1] / bandwidth
    return grad, gather


def step_time(
    config,
    layout,
    hw: Hardware = DEFAULT_HARDWARE,
    cal: Calibration = DEFAULT_CALIBRATION,
    overlap: Overlap = DEFAULT_OVERLAP,
    attention: str = "auto",
    *,
    pipeline: bool = True,
    practice: Practice = DEFAULT_PRACTICE,
) -> StepTime:
    """Project one iteration of `config` (split for the layout's tp / cp) trained with `layout` on `hw`.
    `attention`: the attention kernel ("auto": the one our trainer picks, kernels.py). `pipeline`
    False takes for the pipeline's idle time only what no schedule avoids (`least_idle`, no
    simulation): every other part is the same, so its total is a lower bound. `practice`: what a
    published run of another framework did differently (`Practice`)."""
    par = layout.parallel
    pp, v, m = par.pp, par.virtual_stages, layout.num_microbatches
    work = slowest_rank_work(config, layout, hw, cal, attention, practice.cp_all_gather)
    f_chunk, b_chunk = work.forward_s / v, work.backward_s / v
    kind = par.pipeline_schedule
    w_chunk = work.backward.gemm / 2 / v  # the weight gradients: half the backward's products
    idle = bubble = least_idle(pp, f_chunk, b_chunk, kind, w_chunk, m) if pp > 1 else 0.0
    if pipeline and pp > 1:
        transfer = transfer_seconds(config, layout, hw, cal)
        idle = pipeline_idle(pp, v, m, par.microbatch_group_size, f_chunk, b_chunk, transfer, kind, w_chunk)
        units = bubble_units(pp, v, m, par.microbatch_group_size, kind, w_chunk / b_chunk)
        bubble = units * (f_chunk + b_chunk)
        bubble = min(bubble, idle)  # the rest of the idle time waits for transfers

    grad_s, gather_s = data_parallel_seconds(config, layout, hw, cal, practice.regather_params)
    # --overlap-grad-reduce: buckets reduce while the last microbatch's backward goes on;
    # --overlap-param-gather: the next iteration's first forward waits for each bucket's gather
    # sharded gradients and parameters: each microbatch's reductions and gathers hide behind its passes
    reductions, gathers = dp_collectives(layout, practice.regather_params)
    exposed_grad = (
        reductions * max(0.0, grad_s / reductions - work.backward_s)
        if overlap.grad_reduce or par.ddp.shards_grads
        else grad_s
    )
    exposed_gather = (
        gathers * max(0.0, gather_s / gathers - work.forward_s)
        if overlap.param_gather or par.ddp.shards_params
        else gather_s
    )
    optimizer = (
        optimizer_shard(config, layout)
        * (1.0 - layout.offload_fractions.optimizer)
        * OPTIMIZER_BYTES_PER_PARAMETER
        / (hw.hbm_gbps * 1e9 * cal.hbm_efficiency)
    )
    # copies to and from host run beside the passes: only what outlasts them is exposed
    host = max(
        0.0,
        max(host_traffic_bytes(config, layout)) / (hw.host_link_gbps * 1e9) - m * (work.forward_s + work.backward_s),
    )

    global_batch = layout.micro_batch_size * par.dp * m
    model = flops_per_iteration(config, global_batch)
    extra = recompute_forward_flops(config, global_batch * config.seq_length, config.num_layers)
    forward, backward = work.forward, work.backward
    return StepTime(
        gemm_s=m * (forward.gemm + backward.gemm),
        attention_s=m * (forward.attention + backward.attention),
        elementwise_s=m * (forward.elementwise + backward.elementwise),
        overhead_s=m * (forward.overhead + backward.overhead),
        recompute_s=m * work.recompute.total,
        tp_comm_s=m * work.tp_s,
        cp_comm_s=m * work.cp_s,
        ep_comm_s=m * work.ep_s,
        pp_comm_s=idle - bubble,
        bubble_s=bubble,
        dp_comm_s=exposed_grad + exposed_gather,
        host_s=host,
        optimizer_s=optimizer,
        step_overhead_s=cal.step_overhead_s,
        dp_comm_total_s=grad_s + gather_s,
        model_flops=model,
        hardware_flops=model + extra,
        tokens=global_batch * config.seq_length,
        world_size=par.world_size,
    )


@dataclass(frozen=True)
class Projection:
    """Everything `step_time` needs besides the model and the layout: the cluster, the model's
    constants, the data-parallel overlap, the attention kernel ("auto": the trainer's) and, for a
    published run of another framework, what it did differently (`Practice`)."""

    hw: Hardware = DEFAULT_HARDWARE
    cal: Calibration = DEFAULT_CALIBRATION
    overlap: Overlap = DEFAULT_OVERLAP
    attention: str = "auto"
    practice: Practice = DEFAULT_PRACTICE

    def __call__(self, config, layout) -> StepTime:
        return step_time(config, layout, self.hw, self.cal, self.overlap, self.attention, practice=self.practice)

    def lower_bound(self, config, layout) -> float:
        """Seconds the step takes at least: the projection with the least pipeline idle time."""
        return step_time(
            config, layout, self.hw, self.cal, self.overlap, self.attention, pipeline=False, practice=self.practice
        ).total_s


DEFAULT_PROJECTION = Projection()
