#!/usr/bin/env python
"""Rank the parallel layouts of a model that fit in device memory, fastest first.

    python tools/plan_parallelism.py --num-gpus 64 --device-memory-gb 80 --model-family llama \\
        --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 \\
        --seq-length 4096 --vocab-size 32000 --global-batch-size 1024 --bf16

Enumerates (tp, cp, pp, virtual stages, dp, micro batch, recomputation, replicated or
distributed optimizer) for the given GPUs and global batch, drops layouts whose worst-rank memory estimate is
above 80% of device memory (Fujii et al.'s margin: a recommendation keeps it;
the start-up check refuses only what certainly cannot fit, and the summary says
how many dropped layouts it would still start), ranks the rest by
an analytic step time (megatron/core/memory/step_time.py: compute, tp/cp/dp
communication, our pipeline schedule's bubble) and prints the top ones.

Flags of pretrain_*.py that fix part of the layout restrict the search and may
list several values: --tensor-model-parallel-size 2 4, --context-parallel-size,
--pipeline-model-parallel-size, --num-virtual-stages-per-pipeline-rank,
--micro-batch-size, --recompute-granularity {none,selective,full};
--use-distributed-optimizer plans only the distributed optimizer (default: both).
Sequence parallelism is always on with tp > 1; cp is planned where the sequence splits
into 2 x cp chunks (x tp under SP) and there is no attention dropout.

When no layout fits, it proposes sharding more than the optimizer state first
(--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads, else optim_grads_params,
per layout the lighter that fits; dist-opt column: grads / params), and when that fits
nothing either, the offload optimizer (--use-distributed-optimizer
--optimizer-cpu-offload): the distributed-optimizer layouts that fit with some of their
optimizer state in host memory, each at the smallest --optimizer-offload-fraction (0.01
steps) that fits, least offloaded first, then fastest (the step-time model leaves out the
CPU step), with the host bytes per rank.

Exit status: 0 when some layout fits (with offload or without), 1 when none does, 2 on invalid input.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron.core.memory.estimator import DEFAULT_THRESHOLD  # noqa: E402
from megatron.core.memory.planner import RECOMPUTE, Search, plan, plan_offload, plan_sharded  # noqa: E402
from megatron.core.memory.step_time import Hardware  # noqa: E402
from megatron.training.arguments import GPT_DEFAULTS, ArgumentError, build_parser  # noqa: E402
from megatron.training.memory_check import GIB, device_memory_bytes, run_config_for_tool, tool_parser  # noqa: E402

PROG = "tools/plan_parallelism.py"


def _parser():
    parser = tool_parser(PROG, "Rank the parallel layouts that fit in memory")
    parser.add_argument("--top", type=int, default=10, help="how many layouts to print")
    parser.add_argument("--tensor-model-parallel-size", type=int, nargs="+", dest="tps")
    parser.add_argument("--context-parallel-size", type=int, nargs="+", dest="cps")
    parser.add_argument("--use-distributed-optimizer", action="store_true",
                        help="plan only the distributed optimizer (default: replicated and distributed)")
    parser.add_argument("--pipeline-model-parallel-size", type=int, nargs="+", dest="pps")
    parser.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, nargs="+", dest="vpps")
    parser.add_argument("--micro-batch-size", type=int, nargs="+", dest="mbs", default=[1, 2, 4, 8])
    parser.add_argument("--recompute-granularity", nargs="+", choices=sorted(RECOMPUTE), dest="recompute",
                        default=["none", "selective", "full"])
    parser.add_argument("--sequence-parallel", action="store_true", help="accepted; always on with tp > 1")
    hw = Hardware()
    for name, help_text in (("peak-tflops", "dense peak TFLOP/s per GPU"), ("matmul-efficiency", "achieved fraction"),
                            ("intra-node-gbps", "GB/s per GPU inside a node"),
                            ("inter-node-gbps", "GB/s per GPU across nodes"), ("hbm-gbps", "GB/s of device memory")):
        attr = name.replace("-", "_")
        parser.add_argument(f"--{name}", type=float, default=getattr(hw, attr), help=f"{help_text} (step-time model)")
    parser.add_argument("--gpus-per-node", type=int, default=hw.gpus_per_node)
    return parser


SHARDING_CELLS = {"no_shard": "no", "optim": "yes", "optim_grads": "grads", "optim_grads_params": "params"}
HEADER = "rank  tp  cp  pp vpp   dp  mbs     m  recompute  dist-opt  peak GiB  %dev    step ms  bubble"
OFFLOAD_HEADER = HEADER + "  offload  host GiB"


def _row(rank: int, c, device_bytes: int) -> str:
    lay, est, t = c.layout, c.estimate, c.time
    row = (f"{rank:4d} {lay.tp:3d} {lay.cp:3d} {lay.pp:3d} {lay.virtual_stages:3d} {lay.dp:4d} "
           f"{lay.micro_batch_size:4d} {lay.num_microbatches:5d}  {c.recompute:<9} "
           f"{SHARDING_CELLS[lay.sharding_strategy]:>8} {est.max_total_bytes / GIB:9.2f} "
           f"{100 * est.max_total_bytes / device_bytes:6.1f}% {1e3 * t.total_s:10.2f} {100 * t.bubble_fraction:7.1f}%")
    if lay.offload_fraction:
        row += f" {lay.offload_fraction:8.2f} {_max_host_bytes(c) / GIB:9.2f}"
    return row


def _max_host_bytes(c) -> int:
    return max(r.host_bytes for r in c.estimate.ranks)


def _json(c) -> dict:
    lay, est = c.layout, c.estimate
    return {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "virtual_stages": lay.virtual_stages, "dp": lay.dp,
            "micro_batch_size": lay.micro_batch_size, "num_microbatches": lay.num_microbatches,
            "recompute": c.recompute, "distributed_optimizer": lay.distributed_optimizer,
            "sharding_strategy": lay.sharding_strategy,
            "offload_fraction": lay.offload_fraction, "max_host_bytes": _max_host_bytes(c),
            "max_certain_bytes": est.max_certain_bytes, "max_total_bytes": est.max_total_bytes,
            "step_time_s": c.time.total_s, "bubble_fraction": c.time.bubble_fraction}


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
        run = run_config_for_tool(rest + ["--micro-batch-size", "1"], args.model_family, 1, PROG)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device_bytes = device_memory_bytes(device, args.device_memory_gb)
        if device_bytes is None:
            raise ArgumentError("no device memory known: pass --device-memory-gb")
        search = Search(tps=tuple(args.tps) if args.tps else None, cps=tuple(args.cps) if args.cps else None,
                        pps=tuple(args.pps) if args.pps else None, micro_batch_sizes=tuple(args.mbs),
                        recompute=tuple(args.recompute),
                        distributed_optimizer=(True,) if args.use_distributed_optimizer else (False, True),
                        device_type=args.device_type, virtual_stages=tuple(args.vpps) if args.vpps else None)
        hw = Hardware(peak_tflops=args.peak_tflops, matmul_efficiency=args.matmul_efficiency,
                      intra_node_gbps=args.intra_node_gbps, inter_node_gbps=args.inter_node_gbps,
                      hbm_gbps=args.hbm_gbps, gpus_per_node=args.gpus_per_node)
        batch = run.training.global_batch_size
        fitting, rejected, startable = plan(run.model, args.num_gpus, batch, device_bytes, search=search, hw=hw)
        sharded = [] if fitting else plan_sharded(run.model, args.num_gpus, batch, device_bytes, search=search,
                                                  hw=hw, top=args.top)
        offloaded = [] if fitting or sharded else plan_offload(run.model, args.num_gpus, batch, device_bytes,
                                                               search=search, hw=hw, top=args.top)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    shown = (fitting or sharded or offloaded)[: args.top]
    if args.json:
        print(json.dumps([_json(c) for c in shown], indent=2))
        return 0 if shown else 1
    print(f"> {len(fitting) + rejected} valid layouts for {args.num_gpus} GPUs, global batch {batch}; {rejected} "
          f"above {DEFAULT_THRESHOLD:.0%} of {device_bytes / GIB:.2f} GiB dropped ({startable} of them would still "
          f"start: their certain part fits); {len(fitting)} fit")
    if not shown:
        print("> no layout fits, not even with all optimizer state offloaded to host: add GPUs or lower --seq-length")
        return 1
    if sharded:
        print(f"> no layout fits with replicated or distributed-optimizer buffers; with gradients (dist-opt: grads) "
              f"or parameters too (params) sharded these do: --use-megatron-fsdp --data-parallel-sharding-strategy "
              f"{sharded[0].layout.sharding_strategy} for the first")
    if offloaded:
        best = offloaded[0].layout.offload_fraction
        print(f"> no layout fits without offload; with the offload optimizer these do, least offloaded first (host "
              f"GiB: per rank, the worst): --use-distributed-optimizer --optimizer-cpu-offload "
              f"--optimizer-offload-fraction {best:.2f} for the first")
    print(OFFLOAD_HEADER if offloaded else HEADER)
    for rank, candidate in enumerate(shown, start=1):
        print(_row(rank, candidate, device_bytes))
    print("> step times are an analytic model for ranking (see megatron/core/memory/step_time.py), not predictions"
          + ("; they leave out the CPU step of the offloaded state" if offloaded else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
