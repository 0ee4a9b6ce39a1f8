"""Enumerate parallel layouts, keep those whose memory estimate fits, rank them by step time.

A layout is (tp, cp, pp, virtual stages, dp, micro batch, recomputation, replicated or
distributed optimizer, and for MoE models ep and etp) for a fixed number of GPUs and global
batch. Sequence parallelism is on whenever tp > 1 (same communication volume, less activation
memory); MoE models too, their experts projected as moe_cost.py says. Layouts our
code would refuse (sizes that do not divide, a sequence that does not split into 2 x cp
chunks, cp with attention dropout, interleaving without enough microbatches) are
skipped, using the same validation as training (TransformerConfig, build_schedule).
When none fits, `plan_sharded` proposes sharding gradients or parameters too, then
`plan_offload` the offload optimizer (the distributed-optimizer layouts that fit with the
smallest share of their optimizer state on host), then `plan_host_resident` optim_grads_params
with host-resident chunks placed by --offload-policy auto (estimated with every part on host,
its best case; the run keeps on the device what fits).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import torch

from megatron.core.distributed.model_chunk_buffers import DDPConfig
from megatron.core.optimizer.config import OffloadConfig
from megatron.core.parallel_config import ParallelConfig
from megatron.core.pipeline_parallel.layer_split import layers_per_rank as layer_counts
from megatron.core.pipeline_parallel.schedules import num_warmup_microbatches
from megatron.planning.bounds import certain_lower_bound
from megatron.planning.estimator import MemoryEstimate, estimate_memory
from megatron.planning.fit_rule import fit_verdict
from megatron.planning.hardware import Hardware
from megatron.planning.layout import MemoryLayout
from megatron.planning.offload import fraction_that_fits
from megatron.planning.step_time import DEFAULT_PROJECTION, Projection, StepTime
from megatron.planning.trace import traces_run

RECOMPUTE = {
    "none": dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None),
    "selective": dict(recompute_granularity="selective", recompute_method=None, recompute_num_layers=None),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


@dataclass(frozen=True)
class Candidate:
    config: object  # TransformerConfig of this layout (tp, sequence parallelism, recomputation applied)
    layout: MemoryLayout
    recompute: str
    estimate: MemoryEstimate
    time: StepTime


@dataclass(frozen=True)
class Search:
    """What to enumerate. None: every valid value."""

    tps: tuple[int, ...] | None = None
    cps: tuple[int, ...] | None = None
    pps: tuple[int, ...] | None = None
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    virtual_stages: tuple[int, ...] | None = None
    layers_per_virtual_stage: int | None = None  # --num-layers-per-virtual-pipeline-stage: v from each pp
    max_virtual_stages: int = 8  # the search's bound where no flag fixes the virtual stages
    full_recompute: tuple[str, int] = ("uniform", 1)  # --recompute-method and --recompute-num-layers of "full"
    distributed_optimizer: tuple[bool, ...] = (False, True)
    schedules: tuple[str, ...] | None = None  # pipelines (--pipeline-schedule); None: each with and without deferred W
    device_type: str = "cuda"
    stage_splits: tuple[tuple[int | None, int | None], ...] | None = None  # (first, last) stage layers
    grad_dtype: torch.dtype = torch.float32  # our trainer's gradient buffers; bf16 describes a run with bf16 ones
    eps: tuple[int, ...] | None = None  # MoE: expert-parallel sizes
    etps: tuple[int, ...] | None = None  # MoE: expert-tensor-parallel sizes (None: tp, Megatron's default)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _valid_schedule(pp: int, v: int, m: int) -> bool:
    """Whether build_schedule accepts (pp, v, m) (its argument checks, without building the lists)."""
    try:
        num_warmup_microbatches(pp, v, m, 0)
    except ValueError:
        return False
    return True


def stage_splits(num_layers: int, pp: int) -> list[tuple[int | None, int | None]]:
    """(--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers) to try for pp stages:
    (None, None) for the even split when pp divides the layers; and splits whose first and last
    stages hold fewer layers than the r of every other stage, for r around L / pp (Llama 3's 126
    layers on 16 stages: 7 on the first and the last, 8 on the others), which also lightens the
    stages holding the embedding and the output layer."""
    if pp == 1:
        return [(None, None)]
    splits = [(None, None)] if num_layers % pp == 0 else []
    for middle in sorted({num_layers // pp, -(-num_layers // pp), -(-num_layers // pp) + 1}):
        ends = num_layers - middle * (pp - 2)
        first, last = ends // 2, ends - ends // 2
        for pair in {(first, last), (last, first)}:
            uneven = len({*pair, middle} if pp > 2 else set(pair)) > 1
            if uneven and middle >= 1 and min(pair) >= 1 and max(pair) <= middle:
                splits.append(pair)
    return sorted(set(splits), key=lambda pair: (pair[0] is not None, pair))


def _mesh_shapes(config, num_gpus: int, search: Search, hw: Hardware):
    """(tp, cp, pp, v, dp, (first, last)) that divide the GPUs and the layers; tp stays inside a node."""
    for tp in search.tps or [t for t in _divisors(num_gpus) if t <= hw.gpus_per_node]:
        for cp in search.cps or _divisors(num_gpus):
            if num_gpus % (tp * cp):
                continue
            for pp in search.pps or _divisors(num_gpus // (tp * cp)):
                if num_gpus % (tp * cp * pp):
                    continue
                splits = stage_splits(config.num_layers, pp) if search.stage_splits is None else search.stage_splits
                for first, last in splits:
                    try:
                        counts = layer_counts(config.num_layers, pp, first, last)
                    except ValueError:
                        continue
                    for v in _virtual_stages(counts, search):
                        yield tp, cp, pp, v, num_gpus // (tp * cp * pp), (first, last)


def _virtual_stages(counts: list[int], search: Search) -> list[int]:
    """The virtual stages per pipeline rank to try for these layers per rank, as training derives
    them (training/config.py): --num-layers-per-virtual-pipeline-stage n needs pp > 1 and equal
    ranks of a multiple of n layers, and gives their layers / n; --num-virtual-stages-per-pipeline-rank
    the values listed that divide every rank's layers; else each such value up to max_virtual_stages."""
    valid = [1] if len(counts) == 1 else _divisors(math.gcd(*counts))
    if search.layers_per_virtual_stage is not None:
        n = search.layers_per_virtual_stage
        equal = len(counts) > 1 and len(set(counts)) == 1 and counts[0] % n == 0
        return [counts[0] // n] if equal else []
    if search.virtual_stages is not None:
        return [v for v in valid if v in search.virtual_stages]
    return [v for v in valid if v <= search.max_virtual_stages]


def _expert_sizes(config, stage_ranks: int, tp: int, search: Search):
    """(ep, etp) of a stage of `stage_ranks` = tp x cp x dp ranks, as Megatron constrains them
    (moe/validation.py, ParallelDims): ep divides the experts, etp the expert width, ep x etp the
    stage; (1, None) for a dense model."""
    if config.num_moe_experts is None:
        yield 1, None
        return
    for etp in search.etps or (tp,):
        for ep in search.eps or _divisors(config.num_moe_experts):
            fits = config.num_moe_experts % ep == 0 and stage_ranks % (ep * etp) == 0
            if fits and config.moe_ffn_hidden_size % etp == 0:
                yield ep, etp


def recompute_fields(name: str, search: Search) -> dict:
    """The TransformerConfig recomputation fields of `name` (RECOMPUTE), "full" with the search's method."""
    if name != "full":
        return RECOMPUTE[name]
    method, layers = search.full_recompute
    return dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=layers)


def _split_config(config, tp: int, cp: int, recompute: dict, ep: int, etp: int | None):
    """The model config split for (tp, cp, and for MoE ep, etp) with a recomputation, or None when our
    code refuses it (tp does not divide the heads, groups or ffn; the sequence does not split)."""
    experts = {} if etp is None else dict(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    try:
        return dataclasses.replace(
            config,
            tensor_model_parallel_size=tp,
            sequence_parallel=tp > 1,
            context_parallel_size=cp,
            **recompute,
            **experts,
        )
    except ValueError:
        return None


def enumerate_layouts(config, num_gpus: int, global_batch_size: int, search: Search, hw: Hardware):
    """Yield (config, layout, recompute name) for every valid layout (each split config built once)."""
    configs = {}
    for tp, cp, pp, v, dp, (first, last) in _mesh_shapes(config, num_gpus, search, hw):
        for (ep, etp), mbs in itertools.product(
            _expert_sizes(config, tp * cp * dp, tp, search), search.micro_batch_sizes
        ):
            m = global_batch_size // (mbs * dp)
            if global_batch_size % (mbs * dp) or (v > 1 and not _valid_schedule(pp, v, m)):
                continue
            for name in search.recompute:
                if (tp, cp, name, ep, etp) not in configs:
                    recompute = recompute_fields(name, search)
                    configs[tp, cp, name, ep, etp] = _split_config(config, tp, cp, recompute, ep, etp)
                cfg = configs[tp, cp, name, ep, etp]
                if cfg is None:
                    continue
                for sharded, schedule in itertools.product(search.distributed_optimizer, _schedules(pp, v, search)):
                    ddp = DDPConfig(grad_dtype=search.grad_dtype, use_distributed_optimizer=sharded)
                    parallel = ParallelConfig(
                        tp=tp,
                        cp=cp,
                        pp=pp,
                        dp=dp,
                        virtual_stages=v,
                        ddp=dataclasses.replace(ddp, reshard_after_forward=pp == 1),  # the trainer's default
                        first_stage_layers=first,
                        last_stage_layers=last,
                        ep=ep,
                        etp=etp,
                        pipeline_schedule=schedule,
                    )
                    if schedule == "zbv" and not _splits_into_the_v(parallel, cfg.num_layers):
                        continue
                    yield cfg, MemoryLayout(parallel, mbs, m, device_type=search.device_type), name


def _schedules(pp: int, v: int, search: Search) -> list[str]:
    """The pipeline schedules (ParallelConfig.pipeline_schedule) to try for (pp, v): the one the layout
    implies ('auto') and its zero-bubble variants (zbv where v is 2), or those of `search.schedules`
    that run (pp, v)."""
    if pp == 1:  # no pipeline: what 1f1b is with one stage
        return ["auto"] if search.schedules is None or "1f1b" in search.schedules else []
    plain, *zero_bubble = ("1f1b", "zb-h1") if v == 1 else ("interleaved", "interleaved-zb")
    zero_bubble += ["zbv"] if v == 2 else []
    if search.schedules is None:
        return ["auto", *zero_bubble]
    return [kind for kind in (plain, *zero_bubble) if kind in search.schedules]


def _splits_into_the_v(parallel: ParallelConfig, num_layers: int) -> bool:
    """Whether zbv's V placement splits the layers (layer_split.py: first and last stage, rest even)."""
    try:
        parallel.validate_layers(num_layers)
    except ValueError:
        return False
    return True


def _estimate_unless_bounded(cfg, layout: MemoryLayout, device_bytes: int) -> MemoryEstimate | None:
    """The layout's estimate, or None when its certain part's lower bound from the parameter count
    already exceeds the device (bounds.py: "does not fit" without a trace)."""
    if certain_lower_bound(cfg, layout) > device_bytes:
        return None
    return estimate_memory(cfg, layout)


def evaluate_layout(
    config, layout: MemoryLayout, recompute: str, projection: Projection = DEFAULT_PROJECTION
) -> Candidate:
    """One layout's memory estimate and projected step time, whether it fits or not."""
    return Candidate(config, layout, recompute, estimate_memory(config, layout), projection(config, layout))


def plan(
    config,
    num_gpus: int,
    global_batch_size: int,
    device_bytes: int,
    *,
    search: Search = Search(),
    projection: Projection = DEFAULT_PROJECTION,
) -> tuple[list[Candidate], int, int]:
    """(layouts whose fit verdict is "fits", fastest first; number of valid layouts dropped; how many
    of those fit with a margin only, which the start-up check would still start).

    The planner recommends, so it keeps only "fits" (fit_rule.py): the full estimate, allowances
    included, within device memory."""
    fitting, rejected, startable = [], 0, 0
    for cfg, layout, name in enumerate_layouts(config, num_gpus, global_batch_size, search, projection.hw):
        estimate = _estimate_unless_bounded(cfg, layout, device_bytes)
        verdict = None if estimate is None else fit_verdict(estimate, device_bytes)
        if verdict is None or not verdict.fits:
            rejected += 1
            startable += verdict is not None and not verdict.refused
            continue
        fitting.append(Candidate(cfg, layout, name, estimate, projection(cfg, layout)))
    fitting.sort(key=_rank)
    return fitting, rejected, startable


def _rank(candidate: Candidate) -> tuple:
    """The planner's order: fastest first, then the lighter."""
    return candidate.time.total_s, candidate.estimate.max_total_bytes


@dataclass(frozen=True)
class SearchCounts:
    """What `plan_fastest` did with the valid layouts (`considered`)."""

    considered: int
    pruned: int  # "does not fit" from the parameter count alone (bounds.py), never traced
    skipped: int  # never estimated: their step time's lower bound is above the slowest of the top
    estimated: int  # memory estimated (traced, or from the trace cache)
    fit: int  # of those, "fits" (projected in full)
    margin: int  # of those, "fits with margin": the start-up check would start them
    traces: int  # distinct traces run (trace.py)


def plan_fastest(
    config,
    num_gpus: int,
    global_batch_size: int,
    device_bytes: int,
    *,
    search: Search = Search(),
    projection: Projection = DEFAULT_PROJECTION,
    top: int = 10,
) -> tuple[list[Candidate], SearchCounts]:
    """The `top` layouts of `plan`, the same ones in the same order, found without estimating every
    layout: those the parameter count rules out are pruned (bounds.py), the rest visited in the
    order of a lower bound of their step time (`Projection.lower_bound`, no pipeline simulation),
    each estimated and, when it fits, projected in full; the visit stops at the first layout
    whose bound exceeds the slowest of `top` layouts found (ties visited: `plan`'s order breaks them)."""
    traces_before = traces_run()
    bounded, pruned = [], 0
    for cfg, layout, name in enumerate_layouts(config, num_gpus, global_batch_size, search, projection.hw):
        if certain_lower_bound(cfg, layout) > device_bytes:
            pruned += 1
        else:
            bounded.append((projection.lower_bound(cfg, layout), cfg, layout, name))
    bounded.sort(key=lambda b: b[0])
    best, verdicts = [], []
    for bound, cfg, layout, name in bounded:
        if len(best) == top and bound > best[-1].time.total_s:
            break
        estimate = estimate_memory(cfg, layout)
        verdicts.append(fit_verdict(estimate, device_bytes))
        if verdicts[-1].fits:
            found = Candidate(cfg, layout, name, estimate, projection(cfg, layout))
            best = sorted([*best, found], key=_rank)[:top]
    counts = SearchCounts(
        considered=pruned + len(bounded),
        pruned=pruned,
        skipped=len(bounded) - len(verdicts),
        estimated=len(verdicts),
        fit=sum(v.fits for v in verdicts),
        margin=sum(not v.fits and not v.refused for v in verdicts),
        traces=traces_run() - traces_before,
    )
    return best, counts


SHARDED_STRATEGIES = ("optim_grads", "optim_grads_params")  # lighter first


def plan_sharded(
    config,
    num_gpus: int,
    global_batch_size: int,
    device_bytes: int,
    *,
    search: Search = Search(),
    projection: Projection = DEFAULT_PROJECTION,
    top: int = 10,
) -> list[Candidate]:
    """Up to `top` layouts that fit once the gradients (optim_grads), or the parameters too
    (optim_grads_params), are sharded over dp x cp; per layout the lighter strategy that fits,
    fastest first. For when `plan` finds nothing; before offloading."""
    search = dataclasses.replace(search, distributed_optimizer=(True,))
    proposals = []
    for cfg, layout, name in enumerate_layouts(config, num_gpus, global_batch_size, search, projection.hw):
        if layout.parallel.dp * layout.parallel.cp == 1:
            continue
        for strategy in SHARDED_STRATEGIES:
            sharded = layout.with_ddp(sharding_strategy=strategy)
            estimate = estimate_memory(cfg, sharded)
            if estimate.fits(device_bytes):
                proposals.append(Candidate(cfg, sharded, name, estimate, projection(cfg, sharded)))
                break
    proposals.sort(key=_rank)
    return proposals[:top]


def offload_needed(estimate: MemoryEstimate, device_bytes: int) -> float | None:
    """The share of optimizer state to offload for every rank's full estimate to fit device memory
    (fit_rule's "fits"), before rounding to whole chunks; None when even all of it does not."""
    needs = [fraction_that_fits(r.total_bytes, r.optimizer_bytes, device_bytes) for r in estimate.ranks]
    return None if None in needs else max(needs)


def smallest_offload(config, layout: MemoryLayout, need: float, device_bytes: int) -> MemoryEstimate | None:
    """The estimate at the smallest --optimizer-offload-fraction, in steps of 0.01 from `need` up,
    that fits: the static policy offloads whole chunks, the nearest to the fraction, so `need`
    itself can fall short by up to half a chunk; above it, a bisection (more offload never adds bytes)."""

    def at(percent: int) -> MemoryEstimate:
        offload = OffloadConfig(enabled=True, fraction=percent / 100)
        return estimate_memory(config, dataclasses.replace(layout, offload=offload))

    first = math.ceil(100 * need - 1e-9)
    best = at(first)
    if best.fits(device_bytes):
        return best
    low, high, best = first + 1, 100, None
    while low <= high:
        percent = (low + high) // 2
        estimate = at(percent)
        if estimate.fits(device_bytes):
            best, high = estimate, percent - 1
        else:
            low = percent + 1
    return best


def plan_offload(
    config,
    num_gpus: int,
    global_batch_size: int,
    device_bytes: int,
    *,
    search: Search = Search(),
    projection: Projection = DEFAULT_PROJECTION,
    top: int = 10,
) -> list[Candidate]:
    """Up to `top` distributed-optimizer layouts that fit with the offload optimizer (static policy),
    each at the smallest fraction that fits; least offloaded first (the CPU step it adds hides only
    behind the next forward), then fastest. For when `plan` finds nothing."""
    search = dataclasses.replace(search, distributed_optimizer=(True,))
    needed = []
    for cfg, layout, name in enumerate_layouts(config, num_gpus, global_batch_size, search, projection.hw):
        estimate = estimate_memory(cfg, layout)
        need = offload_needed(estimate, device_bytes)
        if need:  # None: not even full offload fits; 0: fits without
            needed.append((need, Candidate(cfg, layout, name, estimate, projection(cfg, layout))))
    needed.sort(key=lambda n: (n[0], _rank(n[1])))
    proposals = []
    for need, candidate in needed:
        estimate = smallest_offload(candidate.config, candidate.layout, need, device_bytes)
        if estimate is not None:
            proposals.append(dataclasses.replace(candidate, layout=estimate.layout, estimate=estimate))
        if len(proposals) == top:
            break
    proposals.sort(key=lambda c: (c.layout.offload_fractions.optimizer, _rank(c)))
    return proposals


def host_resident(layout: MemoryLayout) -> MemoryLayout:
    """`layout` under optim_grads_params with --offload-policy auto: estimated with every
    parameter, gradient and optimizer shard on host."""
    sharded = layout.with_ddp(sharding_strategy="optim_grads_params")
    return dataclasses.replace(sharded, offload=OffloadConfig(enabled=True, policy="auto"))


def plan_host_resident(
    config,
    num_gpus: int,
    global_batch_size: int,
    device_bytes: int,
    *,
    search: Search = Search(),
    projection: Projection = DEFAULT_PROJECTION,
    top: int = 10,
) -> list[Candidate]:
    """Up to `top` layouts that fit with every chunk's state on host (PatrickStar's placement),
    fastest first, the projection counting the host-link copies that all-on-host placement makes
    (the run's auto policy keeps on the device what fits, so it moves less). For when nothing
    fits with the offload optimizer alone."""
    search = dataclasses.replace(search, distributed_optimizer=(True,))
    proposals = []
    for cfg, layout, name in enumerate_layouts(config, num_gpus, global_batch_size, search, projection.hw):
        placed = host_resident(layout)
        estimate = estimate_memory(cfg, placed)
        if estimate.fits(device_bytes):
            proposals.append(Candidate(cfg, placed, name, estimate, projection(cfg, placed)))
    proposals.sort(key=_rank)
    return proposals[:top]
