"""Megatron's parallelism flags (ParallelConfig.from_args reads them)."""

from __future__ import annotations

import argparse

from megatron.core.distributed.bucket_layout import STRATEGIES
from megatron.core.parallel_state import DEFAULT_ORDER, TP_PP_DP_ORDER

PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv", "interleaved-zb")


def add_parallel_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument(
        "--cp-comm-type",
        nargs="+",
        choices=["p2p", "all_gather"],
        default=["p2p"],
        help="context-parallel attention: ring of K/V blocks (p2p) or all-gather of K/V; Megatron's "
        "per-layer list is accepted when every layer uses the same type",
    )
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int)
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int)
    g.add_argument(
        "--use-tp-pp-dp-mapping",
        action="store_true",
        help="number ranks tp fastest, then cp, pp, dp (Megatron's tp-cp-ep-pp-dp order): the "
        "stages of one pipeline are neighbours, data-parallel replicas furthest apart",
    )
    g.add_argument(
        "--pipeline-schedule",
        choices=PIPELINE_SCHEDULES,
        help="1f1b (default with one model chunk per rank), interleaved (default with virtual stages), "
        "zb-h1 (1F1B whose weight-gradient steps fill the cool-down: zero-bubble's ZB-H1), "
        "interleaved-zb (the interleaved schedule with deferred weight-gradient steps), "
        "zbv (zero-bubble's ZB-V: two model chunks per rank in V placement, the loss on rank 0; "
        "layers split over 2 x pp stages, docs/pipeline.md)",
    )
    g.add_argument(
        "--split-backward",
        action="store_true",
        help="pipeline backward in two steps: input gradients, sent upstream at once, then the linear "
        "layers' weight gradients (zero-bubble's B/W split); shortens the cool-down by (p-1) "
        "weight-gradient times, holds each linear layer's output gradient until then",
    )
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="shard fp32 master weights and Adam moments over dp x cp (ZeRO-1/2): gradients are "
        "reduce-scattered and updated parameters all-gathered, bucket by bucket",
    )
    g.add_argument(
        "--use-megatron-fsdp",
        action="store_true",
        help="shard by --data-parallel-sharding-strategy over dp x cp, on the same buckets",
    )
    g.add_argument(
        "--data-parallel-sharding-strategy",
        choices=STRATEGIES,
        help="with --use-megatron-fsdp (default no_shard): no_shard replicates; optim = "
        "--use-distributed-optimizer; optim_grads also keeps only a shard of the fp32 gradients "
        "(each bucket reduce-scattered per microbatch); optim_grads_params also shards the "
        "parameters (gathered before each use, released after)",
    )
    g.add_argument(
        "--reshard-params-after-forward",
        action=argparse.BooleanOptionalAction,
        help="optim_grads_params: release a bucket's parameters after the forward's last use and gather "
        "them again for backward (default: on without pipeline parallelism; with it, off: a "
        "microbatch's parameters stay gathered from its forward to its backward)",
    )
    g.add_argument(
        "--unsharded-grad-accumulation",
        action="store_true",
        help="optim_grads / optim_grads_params: keep each bucket's whole fp32 gradient across the "
        "microbatches of an iteration and reduce-scatter it once, on the last one (one "
        "reduce-scatter per step instead of one per microbatch, for every bucket's whole "
        "gradient held from the first backward to the last)",
    )
    g.add_argument(
        "--overlap-grad-reduce",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reduce each gradient bucket as soon as backward completes it (default on)",
    )
    g.add_argument(
        "--overlap-param-gather",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --use-distributed-optimizer: start the parameter all-gathers at the end of the "
        "step and wait for each bucket just before the next forward first uses it",
    )
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"])
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument(
        "--ddp-bucket-size",
        type=int,
        help="elements per bucket (memory chunk) of the parameter and gradient buffers "
        "(default max(40M, 1M x dp x cp))",
    )
    f = parser.add_argument_group("failure detection")
    f.add_argument(
        "--heartbeat-timeout-seconds",
        type=float,
        default=30.0,
        help="a rank whose peer (or the rendezvous store) has been silent this long exits with an "
        "error naming it, instead of waiting in a collective; every surviving rank exits within "
        "1.6x this. 0 disables (megatron/training/heartbeat.py)",
    )
    return parser


def cp_comm_type_from_args(args) -> str:
    """The one context-parallel attention type: Megatron also takes one per layer, which must agree here."""
    if len(set(args.cp_comm_type)) > 1:
        raise ValueError(f"--cp-comm-type: one type for every layer only, got {' '.join(args.cp_comm_type)}")
    return args.cp_comm_type[0]


def rank_order_from_args(args) -> tuple[str, ...]:
    """Megatron's rank order: tp-cp-dp-pp by default, tp-cp-pp-dp with --use-tp-pp-dp-mapping."""
    return TP_PP_DP_ORDER if args.use_tp_pp_dp_mapping else DEFAULT_ORDER


def sharding_strategy_from_args(args) -> str:
    """The strategy the flags ask for: --data-parallel-sharding-strategy (which needs
    --use-megatron-fsdp), else optim with --use-distributed-optimizer, else no_shard."""
    strategy = args.data_parallel_sharding_strategy
    if strategy is not None and not args.use_megatron_fsdp:
        raise ValueError("--data-parallel-sharding-strategy needs --use-megatron-fsdp")
    if strategy is None:
        return "optim" if args.use_distributed_optimizer else "no_shard"
    if strategy == "no_shard" and args.use_distributed_optimizer:
        raise ValueError(
            "--use-distributed-optimizer shards the optimizer state: use "
            "--data-parallel-sharding-strategy optim (or a stronger one), not no_shard"
        )
    return strategy


def unsharded_grad_accumulation_from_args(args) -> bool:
    if args.unsharded_grad_accumulation and sharding_strategy_from_args(args) not in (
        "optim_grads",
        "optim_grads_params",
    ):
        raise ValueError(
            "--unsharded-grad-accumulation applies to --data-parallel-sharding-strategy optim_grads or "
            "optim_grads_params (the other strategies keep whole gradient buffers anyway)"
        )
    return args.unsharded_grad_accumulation


def reshard_after_forward_from_args(args, pp: int) -> bool:
    """--reshard-params-after-forward, default on without pipeline parallelism (see its help)."""
    if args.reshard_params_after_forward is not None and sharding_strategy_from_args(args) != "optim_grads_params":
        raise ValueError(
            "--reshard-params-after-forward applies to --data-parallel-sharding-strategy optim_grads_params only"
        )
    return pp == 1 if args.reshard_params_after_forward is None else args.reshard_params_after_forward
