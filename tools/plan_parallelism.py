#!/usr/bin/env python
"""Rank the parallel layouts of a model that fit in device memory, fastest first.

    python tools/plan_parallelism.py --num-gpus 64 --device h100-80gb --model-family llama \\
        --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 \\
        --seq-length 4096 --vocab-size 32000 --global-batch-size 1024 --bf16

Enumerates (tp, cp, pp with even and uneven first/last stages, virtual stages, dp, micro
batch, recomputation, replicated or distributed optimizer) for the given GPUs and global
batch, keeps the layouts whose fit verdict is "fits" (megatron/planning/fit_rule.py, the rule the
start-up check and tools/estimate_memory.py report too: the full estimate, its named allowances
included, within device memory), ranks them by a projected step time
(megatron/planning/step_time.py, calibrated on published runs: docs/planner.md) and prints the
top ones with their model TFLOP/s per GPU. The search prunes the layouts whose parameters alone
do not fit, and estimates the rest in the order of a lower bound of their step time until no
layout left can beat the --top found (planner.plan_fastest: the same top as estimating every
layout); the summary says how many layouts were pruned, not estimated, estimated and traced,
and of those how many fit, fit with a margin only (the start-up check would start them) or not.
--device picks a GPU preset (megatron/planning/hardware.py, docs/planner.md;
default h100-80gb for the step time; its memory unless --device-memory-gb is given);
--peak-tflops, --fp8-peak-tflops, --hbm-gbps, --intra-node-gbps, --inter-node-gbps, --host-link-gbps and
--gpus-per-node override its figures. With --fp8-format (and the other FP8 flags of training) the linear
layers' GEMMs are projected at the FP8 rate (docs/planner.md, "FP8"); a device without FP8 is refused.
--explain prints the step-time breakdown of the first layout;
--json gives per layout predicted_step_time_s, predicted_tokens_per_s,
predicted_model_tflops_per_gpu, predicted_hardware_tflops_per_gpu and the breakdown.
--overlap-grad-reduce / --overlap-param-gather (pretrain flags) decide what of the
data-parallel communication the projection hides behind computation.

When every layout flag below is restricted to one value, that layout is evaluated (with both
optimizers unless --use-distributed-optimizer): printed with its projection whether it fits or
not, and when it does not, why (exit 1 when neither fits).

Flags of pretrain_*.py that fix part of the layout restrict the search and may
list several values: --tensor-model-parallel-size 2 4, --context-parallel-size,
--pipeline-model-parallel-size, --num-virtual-stages-per-pipeline-rank,
--micro-batch-size, --recompute-granularity {none,selective,full} (--recompute-activations: selective);
one value: --num-layers-per-virtual-pipeline-stage (virtual stages from each pp, as training derives them),
--recompute-method and --recompute-num-layers (of full recomputation; default uniform, 1),
--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers;
--use-distributed-optimizer plans only the distributed optimizer (default: both).
Sequence parallelism is always on with tp > 1; cp is planned where the sequence splits
into 2 x cp chunks (x tp under SP) and there is no attention dropout.

MoE models (--num-experts): ep is searched too, every size that divides the experts and, times
etp, the ranks of a stage (tp x cp x dp), as Megatron requires; --expert-model-parallel-size
restricts it (several values allowed) and --expert-tensor-parallel-size sets etp (default: tp, as
Megatron). Their layouts are ranked by projected step time like dense ones (the experts, the
token dispatch over ep and the load imbalance: megatron/planning/moe_cost.py).

When no layout fits, it proposes sharding more than the optimizer state first
(--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads, else optim_grads_params,
per layout the lighter that fits; dist-opt column: grads / params), and when that fits
nothing either, the offload optimizer (--use-distributed-optimizer
--optimizer-cpu-offload): the distributed-optimizer layouts that fit with some of their
optimizer state in host memory, each at the smallest --optimizer-offload-fraction (0.01
steps) that fits, least offloaded first, then fastest (the step-time model leaves out the
CPU step), with the host bytes per rank.

Exit status: 0 when some layout fits (with offload or without), 1 when none does (or the given
one does not), 2 on invalid input.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron.planning.budget import GIB, device_memory_bytes  # noqa: E402
from megatron.planning.fit_rule import fit_verdict  # noqa: E402
from megatron.planning.hardware import DEFAULT_DEVICE, DEVICES, Hardware  # noqa: E402
from megatron.planning.planner import (  # noqa: E402
    RECOMPUTE,
    Search,
    enumerate_layouts,
    evaluate_layout,
    plan_fastest,
    plan_host_resident,
    plan_offload,
    plan_sharded,
)
from megatron.planning.startup_check import refusal  # noqa: E402
from megatron.planning.step_time import Overlap, Projection  # noqa: E402
from megatron.training.arguments.parallel import PIPELINE_SCHEDULES  # noqa: E402
from megatron.training.arguments.parser import GPT_DEFAULTS, ArgumentError, build_parser  # noqa: E402
from megatron.training.arguments.tool_command_line import run_config_for_tool, tool_parser  # noqa: E402

PROG = "tools/plan_parallelism.py"


def _parser():
    parser = tool_parser(PROG, "Rank the parallel layouts that fit in memory by their projected step time")
    parser.add_argument("--top", type=int, default=10, help="how many layouts to print")
    parser.add_argument(
        "--explain", action="store_true", help="print the step-time breakdown of the first layout printed"
    )
    parser.add_argument("--tensor-model-parallel-size", type=int, nargs="+", dest="tps")
    parser.add_argument("--context-parallel-size", type=int, nargs="+", dest="cps")
    parser.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="plan only the distributed optimizer (default: replicated and distributed)",
    )
    parser.add_argument("--pipeline-model-parallel-size", type=int, nargs="+", dest="pps")
    parser.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, nargs="+", dest="vpps")
    parser.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        dest="layers_per_virtual_stage",
        help="as in training: virtual stages = layers per pipeline rank / this (pp > 1, equal stages)",
    )
    parser.add_argument(
        "--pipeline-schedule",
        nargs="+",
        choices=PIPELINE_SCHEDULES,
        dest="schedules",
        help="plan only these pipeline schedules (and pp > 1); default: each pipeline layout with the "
        "schedule its virtual stages imply and with its zero-bubble variants (zbv where a rank holds 2 chunks)",
    )
    parser.add_argument("--micro-batch-size", type=int, nargs="+", dest="mbs", default=[1, 2, 4, 8])
    parser.add_argument("--recompute-granularity", nargs="+", choices=sorted(RECOMPUTE), dest="recompute")
    parser.add_argument(
        "--recompute-activations", action="store_true", help="Megatron's alias of --recompute-granularity selective"
    )
    parser.add_argument(
        "--recompute-method", choices=["uniform", "block"], help="of full recomputation (default uniform)"
    )
    parser.add_argument("--recompute-num-layers", type=int, help="of full recomputation (default 1)")
    parser.add_argument("--sequence-parallel", action="store_true", help="accepted; always on with tp > 1")
    parser.add_argument(
        "--expert-model-parallel-size", type=int, nargs="+", dest="eps", help="MoE: ep (default: every valid one)"
    )
    parser.add_argument(
        "--expert-tensor-parallel-size", type=int, nargs="+", dest="etps", help="MoE: etp (default: tp)"
    )
    parser.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        dest="first_layers",
        help="layers of the first pipeline stage (default: try even and uneven splits)",
    )
    parser.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        dest="last_layers",
        help="layers of the last pipeline stage (default: try even and uneven splits)",
    )
    for name, help_text in (
        ("peak-tflops", "dense fp16/bf16 peak TFLOP/s per GPU"),
        ("fp8-peak-tflops", "dense FP8 peak TFLOP/s per GPU (what --fp8-format's GEMMs run at)"),
        ("hbm-gbps", "GB/s of device memory"),
        ("intra-node-gbps", "NVLink GB/s per GPU"),
        ("inter-node-gbps", "network GB/s per GPU across nodes"),
        ("host-link-gbps", "host link (PCIe) GB/s per GPU and direction"),
    ):
        parser.add_argument(f"--{name}", type=float, help=f"{help_text} (default: the --device preset's)")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the --device preset's)")
    return parser


SHARDING_CELLS = {"no_shard": "no", "optim": "yes", "optim_grads": "grads", "optim_grads_params": "params"}
HEADER = (
    "rank  tp  cp  pp vpp   dp  mbs     m  recompute  dist-opt  peak GiB  %dev    step ms  bubble  model TF/s  stages"
)
OFFLOAD_HEADER = HEADER + "  offload  host GiB"


def _stages(lay) -> str:
    """first/last stage layers of an uneven split ('=': that stage gets the even share), else '-'."""
    if lay.parallel.first_stage_layers is None and lay.parallel.last_stage_layers is None:
        return "-"
    return f"{lay.parallel.first_stage_layers or '='}/{lay.parallel.last_stage_layers or '='}"


def _schedule(par) -> str:
    """The pipeline schedule's name (--pipeline-schedule), '-' without pipelining."""
    if par.pp == 1:
        return "-"
    if par.pipeline_schedule != "auto":
        return par.pipeline_schedule
    return "interleaved" if par.virtual_stages > 1 else "1f1b"


def _header(candidates, offload: bool) -> str:
    experts = any(c.config.num_moe_experts is not None for c in candidates)
    return (OFFLOAD_HEADER if offload else HEADER) + ("   ep  etp" if experts else "") + "  schedule"


def _row(rank: int, c, device_bytes: int) -> str:
    lay, est, t = c.layout, c.estimate, c.time
    par = lay.parallel
    time = f"{1e3 * t.total_s:10.2f} {100 * t.bubble_fraction:7.1f}% {t.model_tflops_per_gpu:11.1f}"
    row = (
        f"{rank:4d} {par.tp:3d} {par.cp:3d} {par.pp:3d} {par.virtual_stages:3d} {par.dp:4d} "
        f"{lay.micro_batch_size:4d} {lay.num_microbatches:5d}  {c.recompute:<9} "
        f"{SHARDING_CELLS[lay.parallel.ddp.sharding_strategy]:>8} {est.max_total_bytes / GIB:9.2f} "
        f"{100 * est.max_total_bytes / device_bytes:6.1f}% {time}  {_stages(lay):>6}"
    )
    if lay.offload_fractions.optimizer:
        row += f" {lay.offload_fractions.optimizer:8.2f} {_max_host_bytes(c) / GIB:9.2f}"
    if c.config.num_moe_experts is not None:
        row += f" {par.ep:4d} {par.dims.etp:4d}"
    return row + f"  {_schedule(par)}"


def _max_host_bytes(c) -> int:
    return max(r.host_bytes for r in c.estimate.ranks)


def _json(c, device_bytes: int, why: str | None = None) -> dict:
    lay, est, t = c.layout, c.estimate, c.time
    return {
        "tp": lay.parallel.tp,
        "cp": lay.parallel.cp,
        "pp": lay.parallel.pp,
        "virtual_stages": lay.parallel.virtual_stages,
        "pipeline_schedule": _schedule(lay.parallel),
        "dp": lay.parallel.dp,
        "ep": lay.parallel.ep,
        "etp": lay.parallel.dims.etp,
        "micro_batch_size": lay.micro_batch_size,
        "num_microbatches": lay.num_microbatches,
        "decoder_first_pipeline_num_layers": lay.parallel.first_stage_layers,
        "decoder_last_pipeline_num_layers": lay.parallel.last_stage_layers,
        "recompute": c.recompute,
        "recompute_method": c.config.recompute_method,
        "recompute_num_layers": c.config.recompute_num_layers,
        "distributed_optimizer": lay.parallel.ddp.use_distributed_optimizer,
        "sharding_strategy": lay.parallel.ddp.sharding_strategy,
        "offload_fraction": lay.offload_fractions.optimizer,
        "max_host_bytes": _max_host_bytes(c),
        "max_certain_bytes": est.max_certain_bytes,
        "max_total_bytes": est.max_total_bytes,
        "fits": why is None,
        "verdict": fit_verdict(est, device_bytes).label,
        "why_not": why,
        **_json_time(t),
    }


def _json_time(t) -> dict:
    """The projection's keys."""
    keys = ("predicted_step_time_s", "predicted_tokens_per_s", "predicted_model_tflops_per_gpu")
    keys += ("predicted_hardware_tflops_per_gpu", "breakdown", "step_time_s", "bubble_fraction")
    values = (t.total_s, t.tokens_per_s, t.model_tflops_per_gpu, t.hardware_tflops_per_gpu, t.breakdown())
    return dict(zip(keys, values + (t.total_s, t.bubble_fraction)))


def explain(c, hw: Hardware) -> list[str]:
    """The step-time breakdown of one layout, one line per part (or why there is none)."""
    t = c.time
    lines = [
        f"> step time of {c.layout.describe()}, recompute {c.recompute}, on {hw.peak_tflops:g} TFLOP/s"
        f"{'' if c.config.fp8 is None else f' (FP8 {c.config.fp8.recipe} GEMMs at {hw.fp8_tflops:g})'}, "
        f"{hw.hbm_gbps:g} GB/s HBM, {hw.intra_node_gbps:g} GB/s NVLink, {hw.inter_node_gbps:g} GB/s network "
        f"per GPU, {hw.gpus_per_node} GPUs per node (slowest pipeline rank):"
    ]
    what = {
        "gemm_s": "GEMMs (forward + backward)",
        "attention_s": "attention core",
        "elementwise_s": "norms, activations, dropout, loss (HBM bytes)",
        "overhead_s": "host launch overhead of the layers",
        "recompute_s": "recomputed forward",
        "tp_comm_s": "tensor-parallel collectives",
        "cp_comm_s": "context-parallel ring (not hidden by attention)",
        "ep_comm_s": "MoE token dispatch and combine over ep",
        "pp_comm_s": "pipeline transfers not hidden",
        "bubble_s": "pipeline bubble",
        "dp_comm_s": f"data-parallel communication not hidden (of {1e3 * t.dp_comm_total_s:.1f} ms)",
        "host_s": "host-resident chunks' copies not hidden (PCIe)",
        "optimizer_s": "optimizer step on the device",
        "step_overhead_s": "per-iteration host work (fitted)",
    }
    for name in t.PARTS:
        seconds = getattr(t, name)
        lines.append(f"  {what[name]:<52} {1e3 * seconds:12.2f} ms {100 * seconds / t.total_s:6.1f}%")
    lines.append(
        f"  {'total':<52} {1e3 * t.total_s:12.2f} ms: {t.tokens_per_s:,.0f} tokens/s, "
        f"{t.model_tflops_per_gpu:.1f} model TFLOP/s per GPU ({t.hardware_tflops_per_gpu:.1f} with "
        f"recomputation), MFU {t.model_tflops_per_gpu / hw.peak_tflops:.1%}"
    )
    return lines


def _hardware(args) -> Hardware:
    base = DEVICES[args.device or DEFAULT_DEVICE]
    given = {
        name: getattr(args, name)
        for name in ("peak_tflops", "hbm_gbps", "intra_node_gbps", "inter_node_gbps", "host_link_gbps", "gpus_per_node")
        if getattr(args, name) is not None
    }
    if args.fp8_peak_tflops is not None:
        given["fp8_tflops"] = args.fp8_peak_tflops
    return dataclasses.replace(base, **given)


def _why_not(estimate, device_bytes: int) -> str:
    verdict = fit_verdict(estimate, device_bytes)
    if verdict.refused:
        return f"{verdict.describe()}; the start-up check refuses it: {refusal(estimate, device_bytes)}"
    return f"{verdict.describe()}; the start-up check would still start it, with a warning"


def main(argv: list[str]) -> int:
    parser = _parser()
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        build_parser(GPT_DEFAULTS, "pretrain_*.py model flags").print_help()
        return 0
    try:
        args, rest = parser.parse_known_args(argv)
        if not any(t == "--global-batch-size" or t.startswith("--global-batch-size=") for t in rest):
            raise ArgumentError("--global-batch-size is required: the planner keeps it fixed across layouts")
        if args.num_gpus < 1 or args.top < 1 or min(args.mbs) < 1 or min(args.cps or [1]) < 1:
            raise ArgumentError("--num-gpus, --top, --micro-batch-size and --context-parallel-size must be >= 1")
        if args.device_memory_gb is not None and args.device_memory_gb <= 0:
            raise ArgumentError(f"--device-memory-gb must be > 0, got {args.device_memory_gb}")
        if min(n for n in (args.first_layers, args.last_layers, 1) if n is not None) < 1:
            raise ArgumentError("--decoder-first/last-pipeline-num-layers must be >= 1")
        if min(args.eps or [1]) < 1 or min(args.etps or [1]) < 1:
            raise ArgumentError("--expert-model-parallel-size and --expert-tensor-parallel-size must be >= 1")
        recompute, full_recompute = _recompute(args)
        _check_virtual_stages(args)
        if args.schedules and args.pps and max(args.pps) == 1:
            raise ArgumentError(f"--pipeline-schedule {args.schedules[0]} needs --pipeline-model-parallel-size > 1")
        run = run_config_for_tool(rest + ["--micro-batch-size", "1"], args.model_family, 1, PROG)
        if (args.eps or args.etps) and run.model.num_moe_experts is None:
            raise ArgumentError("--expert-model-parallel-size and --expert-tensor-parallel-size need --num-experts")
        hw = _hardware(args)
        if run.model.fp8 is not None and hw.fp8_tflops is None:
            raise ArgumentError(
                f"--fp8-format: --device {args.device} has no FP8 tensor cores (compute capability below 8.9: "
                "training refuses FP8 there); plan on an FP8 device (h100-80gb, h200, b200, ...) or give "
                "--fp8-peak-tflops"
            )
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device_bytes = device_memory_bytes(device, args.device_memory_gb, args.device)
        if device_bytes is None:
            raise ArgumentError("no device memory known: pass --device or --device-memory-gb")
        uneven = args.first_layers is not None or args.last_layers is not None
        search = Search(
            tps=tuple(args.tps) if args.tps else None,
            cps=tuple(args.cps) if args.cps else None,
            pps=tuple(args.pps) if args.pps else None,
            micro_batch_sizes=tuple(args.mbs),
            recompute=recompute,
            full_recompute=full_recompute,
            distributed_optimizer=(True,) if args.use_distributed_optimizer else (False, True),
            device_type=args.device_type,
            virtual_stages=tuple(args.vpps) if args.vpps else None,
            layers_per_virtual_stage=args.layers_per_virtual_stage,
            stage_splits=((args.first_layers, args.last_layers),) if uneven else None,
            eps=tuple(args.eps) if args.eps else None,
            etps=tuple(args.etps) if args.etps else None,
            schedules=tuple(args.schedules) if args.schedules else None,
        )
        ddp = run.parallel.ddp
        projection = Projection(
            hw=hw, overlap=Overlap(grad_reduce=ddp.overlap_grad_reduce, param_gather=ddp.overlap_param_gather)
        )
        batch = run.training.global_batch_size
        layouts = list(enumerate_layouts(run.model, args.num_gpus, batch, search, hw))
        if _one_layout(layouts):  # every layout flag restricted to one value: evaluate it (with either optimizer)
            return _print_given([evaluate_layout(*given, projection) for given in layouts], device_bytes, args, hw)
        fitting, counts = plan_fastest(
            run.model, args.num_gpus, batch, device_bytes, search=search, projection=projection, top=args.top
        )
        sharded = (
            []
            if fitting
            else plan_sharded(
                run.model, args.num_gpus, batch, device_bytes, search=search, projection=projection, top=args.top
            )
        )
        offloaded = (
            []
            if fitting or sharded
            else plan_offload(
                run.model, args.num_gpus, batch, device_bytes, search=search, projection=projection, top=args.top
            )
        )
        resident = (
            []
            if fitting or sharded or offloaded
            else plan_host_resident(
                run.model, args.num_gpus, batch, device_bytes, search=search, projection=projection, top=args.top
            )
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    shown = (fitting or sharded or offloaded or resident)[: args.top]
    if args.json:
        print(json.dumps([_json(c, device_bytes) for c in shown], indent=2))
        return 0 if shown else 1
    print(
        f"> {counts.considered} valid layouts for {args.num_gpus} GPUs, global batch {batch}, "
        f"{device_bytes / GIB:.2f} GiB: {counts.pruned} pruned (their parameters alone do not fit), "
        f"{counts.skipped} not estimated (a lower bound of their step time is above the slowest of the "
        f"{args.top} fastest that fit), {counts.estimated} estimated ({counts.traces} traces): {counts.fit} fit, "
        f"{counts.margin} fit with a margin only (the start-up check would start them), "
        f"{counts.estimated - counts.fit - counts.margin} do not fit"
    )
    if not shown:
        print(
            "> no layout fits, not even with every parameter, gradient and optimizer shard on host: add GPUs or "
            "lower --seq-length"
        )
        return 1
    if sharded:
        print(
            f"> no layout fits with replicated or distributed-optimizer buffers; with gradients (dist-opt: grads) "
            f"or parameters too (params) sharded these do: --use-megatron-fsdp --data-parallel-sharding-strategy "
            f"{sharded[0].layout.parallel.ddp.sharding_strategy} for the first"
        )
    if offloaded:
        best = offloaded[0].layout.offload_fractions.optimizer
        print(
            f"> no layout fits without offload; with the offload optimizer these do, least offloaded first (host "
            f"GiB: per rank, the worst): --use-distributed-optimizer --optimizer-cpu-offload "
            f"--optimizer-offload-fraction {best:.2f} for the first"
        )
    if resident:
        print(
            "> no layout fits with the offload optimizer alone; with host-resident chunks these do (estimated with "
            "every shard on host; the run keeps on the device what fits): --use-megatron-fsdp "
            "--data-parallel-sharding-strategy optim_grads_params --optimizer-cpu-offload --offload-policy auto"
        )
    print(_header(shown, offloaded or resident))
    for rank, candidate in enumerate(shown, start=1):
        print(_row(rank, candidate, device_bytes))
    if args.explain:
        print("\n".join(explain(shown[0], hw)))
    print(_step_time_note(run.model, offloaded or resident))
    return 0


def _recompute(args) -> tuple[tuple[str, ...], tuple[str, int]]:
    """(the recomputations to plan, full recomputation's method and layers), checked as training checks
    the flags (megatron/training/arguments/model.py, TransformerConfig); no granularity given: all three."""
    granularities = args.recompute
    if args.recompute_activations:
        if granularities not in (None, ["selective"]):
            raise ArgumentError(
                f"--recompute-activations (selective) contradicts --recompute-granularity {' '.join(granularities)}"
            )
        granularities = ["selective"]
    granularities = tuple(granularities or ("none", "selective", "full"))
    if "full" not in granularities:
        if args.recompute_method is not None:
            raise ArgumentError("--recompute-method only applies with --recompute-granularity full")
        if args.recompute_num_layers is not None:
            raise ArgumentError("--recompute-num-layers only applies with --recompute-granularity full")
    if args.recompute_num_layers is not None and args.recompute_num_layers < 1:
        raise ArgumentError("--recompute-granularity full needs --recompute-num-layers >= 1")
    return granularities, (args.recompute_method or "uniform", args.recompute_num_layers or 1)


def _check_virtual_stages(args) -> None:
    """The virtual-stage flags' checks of training (training/config.py), where the search cannot make them."""
    if args.layers_per_virtual_stage is None:
        return
    if args.vpps:
        raise ArgumentError(
            "give only one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank"
        )
    if args.layers_per_virtual_stage < 1:
        raise ArgumentError("--num-layers-per-virtual-pipeline-stage must be >= 1")
    if args.pps and max(args.pps) == 1:
        raise ArgumentError("virtual pipeline stages need --pipeline-model-parallel-size > 1")


def _step_time_note(config, offloaded: bool) -> str:
    note = "> step times: a projection calibrated on published runs (docs/planner.md: how close it lands, what "
    return note + "it leaves out)" + ("; they leave out the CPU step of the offloaded state" if offloaded else "")


def _one_layout(layouts) -> bool:
    """Whether the enumerated layouts differ at most in the optimizer (which no flag restricts to the
    replicated one)."""
    shapes = {tuple(lay.replicated().to_dict().items()) for _, lay, _ in layouts}
    return len(shapes) == 1 and len({name for _, _, name in layouts}) == 1


def _print_given(candidates, device_bytes: int, args, hw: Hardware) -> int:
    """A layout given by the flags: always printed with its projection, and whether it fits and why not."""
    whys = [None if c.estimate.fits(device_bytes) else _why_not(c.estimate, device_bytes) for c in candidates]
    fits = any(why is None for why in whys)
    if args.json:
        print(json.dumps([_json(c, device_bytes, why) for c, why in zip(candidates, whys)], indent=2))
        return 0 if fits else 1
    print(_header(candidates, offload=False))
    for rank, candidate in enumerate(candidates, start=1):
        print(_row(rank, candidate, device_bytes))
    for rank, (candidate, why) in enumerate(zip(candidates, whys), start=1):
        if args.explain:
            print("\n".join(explain(candidate, hw)))
        print(f"> layout {rank} fits: {'yes' if why is None else 'no, ' + why}")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
