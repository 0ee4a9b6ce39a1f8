"""Megatron's mixture-of-experts flags -> the MoE fields of TransformerConfig (megatron-core's names)."""

from __future__ import annotations

import argparse
import re

from megatron.core.transformer.moe.experts import grouped_fallback_reason

# the flags below, by TransformerConfig field; a flag given without --num-experts is refused by name
MOE_FIELDS = {
    "num_moe_experts": "--num-experts",
    "moe_layer_freq": "--moe-layer-freq",
    "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "moe_shared_expert_gate": "--moe-shared-expert-gate",
    "moe_router_topk": "--moe-router-topk",
    "moe_router_score_function": "--moe-router-score-function",
    "moe_router_pre_softmax": "--moe-router-pre-softmax",
    "moe_router_topk_scaling_factor": "--moe-router-topk-scaling-factor",
    "moe_router_num_groups": "--moe-router-num-groups",
    "moe_router_group_topk": "--moe-router-group-topk",
    "moe_router_enable_expert_bias": "--moe-router-enable-expert-bias",
    "moe_router_bias_update_rate": "--moe-router-bias-update-rate",
    "moe_router_load_balancing_type": "--moe-router-load-balancing-type",
    "moe_aux_loss_coeff": "--moe-aux-loss-coeff",
    "moe_z_loss_coeff": "--moe-z-loss-coeff",
    "moe_router_dtype": "--moe-router-dtype",
    "moe_expert_capacity_factor": "--moe-expert-capacity-factor",
    "moe_token_drop_policy": "--moe-token-drop-policy",
    "moe_pad_expert_input_to_capacity": "--moe-pad-expert-input-to-capacity",
    "moe_grouped_gemm": "--moe-grouped-gemm",
    "moe_token_dispatcher_type": "--moe-token-dispatcher-type",
    "expert_model_parallel_size": "--expert-model-parallel-size",
    "expert_tensor_parallel_size": "--expert-tensor-parallel-size",
}
_PATTERN = re.compile(r"^[\[\]()0-9+*, ]+$")


def moe_layer_freq(value: str):
    """Megatron's --moe-layer-freq: an int, or a Python list expression such as ([0]+[1]*3)*2."""
    value = value.strip()
    if value.lstrip("-").isdigit():
        return int(value)
    if not _PATTERN.match(value):
        raise argparse.ArgumentTypeError(f"not an int or a list expression of 0s and 1s: {value!r}")
    try:
        pattern = eval(value, {"__builtins__": {}})  # only brackets, digits, + and * pass the pattern above
    except SyntaxError as error:
        raise argparse.ArgumentTypeError(f"not a list expression: {value!r}") from error
    if not isinstance(pattern, list):
        raise argparse.ArgumentTypeError(f"not a list: {value!r}")
    return pattern


def add_moe_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", dest="num_moe_experts", type=int, help="experts per MoE layer (none: dense)")
    g.add_argument("--moe-layer-freq", type=moe_layer_freq, default=1, help="every n-th layer, or a 0/1 list")
    g.add_argument("--moe-ffn-hidden-size", type=int, help="each expert's intermediate size (--ffn-hidden-size)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int)
    g.add_argument("--moe-shared-expert-gate", action="store_true", help="sigmoid gate on the shared expert")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-score-function", default="softmax", help="softmax or sigmoid")
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-topk-scaling-factor", type=float)
    g.add_argument("--moe-router-num-groups", type=int)
    g.add_argument("--moe-router-group-topk", type=int)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true", help="aux-loss-free balancing")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default=["aux_loss"])
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=[0.0])
    g.add_argument("--moe-z-loss-coeff", type=float)
    g.add_argument("--moe-router-dtype", help="fp32 or fp64: routing in that precision")
    g.add_argument("--moe-expert-capacity-factor", type=float, help="none: dropless")
    g.add_argument("--moe-token-drop-policy", default="probs", help="probs or position")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument(
        "--moe-grouped-gemm",
        action="store_true",
        help="the local experts of a layer as one [experts, out, in] weight per linear, run by torch's grouped GEMM",
    )
    g.add_argument("--moe-token-dispatcher-type", default="allgather", help="allgather or alltoall")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, help="default: --tensor-model-parallel-size")
    return parser


def _single(args, name: str):
    values = getattr(args, name)
    if len(values) != 1:
        raise ValueError(f"{MOE_FIELDS[name]} takes one value here (one load-balancing type), got {values}")
    return values[0]


def moe_fields_from_args(args) -> dict:
    """TransformerConfig's MoE keyword arguments; a MoE flag set without --num-experts is one error line."""
    fields = {name: getattr(args, name) for name in MOE_FIELDS}
    fields["moe_router_load_balancing_type"] = _single(args, "moe_router_load_balancing_type")
    fields["moe_aux_loss_coeff"] = _single(args, "moe_aux_loss_coeff")
    if fields["num_moe_experts"] is None:
        defaults = vars(add_moe_arguments(argparse.ArgumentParser()).parse_args([]))
        given = [flag for name, flag in MOE_FIELDS.items() if getattr(args, name) != defaults[name]]
        if given:
            raise ValueError(f"{' '.join(given)} need --num-experts (a model with experts)")
    return fields


def moe_notes(config) -> list[str]:
    """Start-up lines about how the MoE layers run here."""
    if config.num_moe_experts is None:
        return []
    notes = [
        f"> MoE: {config.num_moe_experts} experts, top-{config.moe_router_topk} "
        f"{config.moe_router_score_function} routing, {config.moe_token_dispatcher_type} dispatcher, "
        f"{'dropless' if config.moe_expert_capacity_factor is None else 'capacity factor '}"
        f"{'' if config.moe_expert_capacity_factor is None else config.moe_expert_capacity_factor}"
    ]
    if config.moe_grouped_gemm:
        notes.append("> MoE: grouped experts run by torch.nn.functional.grouped_mm")
        for device_type in ("cuda", "cpu"):
            reason = grouped_fallback_reason(config, config.expert_tensor_parallel_size, device_type)
            if reason is not None:
                notes.append(
                    f"> note: --moe-grouped-gemm: {reason}; there the grouped expert weights run one GEMM per expert"
                )
    return notes


def refuse_moe_checkpoints(config, checkpoint, parallel) -> None:
    """MoE layouts whose distributed-optimizer state (Megatron-LM's dp_reshardable torch_dist buckets) is not
    written here: --moe-grouped-gemm (Megatron-LM's local GroupedMLP keeps each layer's experts in two
    weights, another bucket layout), and expert tensor parallelism without expert parallelism."""
    if config.num_moe_experts is None or not (
        checkpoint.ckpt_format == "torch_dist" and checkpoint.save and parallel.ddp.use_distributed_optimizer
    ):
        return
    etp = parallel.etp or parallel.tp
    refused = {
        "--moe-grouped-gemm (Megatron-LM's GroupedMLP buffers)": config.moe_grouped_gemm,
        f"--expert-tensor-parallel-size {etp} != --tensor-model-parallel-size {parallel.tp} without expert "
        "parallelism": parallel.ep == 1 and etp != parallel.tp,
    }
    for what in (what for what, present in refused.items() if present):
        raise ValueError(
            f"--ckpt-format torch_dist --use-distributed-optimizer with {what}: the distributed optimizer's "
            "dp_reshardable bucket state is not written for it here; save with --ckpt-format canonical, or without "
            "--use-distributed-optimizer"
        )
