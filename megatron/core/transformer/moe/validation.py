"""Which layers are MoE layers, and the MoE fields of a TransformerConfig checked: one line per mistake."""

from __future__ import annotations

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
DROP_POLICIES = ("probs", "position")
DISPATCHERS = ("alltoall", "allgather")
ROUTER_DTYPES = (None, "fp32", "fp64")


def moe_layer_pattern(freq, num_layers: int) -> list[bool]:
    """Megatron's --moe-layer-freq: an int n makes layers 0, n, 2n, ... MoE layers; a list gives one 0/1 per layer."""
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"--moe-layer-freq must be >= 1, got {freq}")
        return [i % freq == 0 for i in range(num_layers)]
    if len(freq) != num_layers or any(v not in (0, 1) for v in freq):
        raise ValueError(
            f"--moe-layer-freq as a list needs one 0 or 1 per layer (--num-layers {num_layers}), got {list(freq)}"
        )
    return [bool(v) for v in freq]


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def validate_moe(c) -> None:
    """Megatron-core's checks of the MoE fields, plus refusals of what is not built here."""
    if c.num_moe_experts is None:
        _need(c.expert_model_parallel_size == 1, "--expert-model-parallel-size needs --num-experts")
        return
    experts, topk = c.num_moe_experts, c.moe_router_topk
    _need(experts >= 1, f"--num-experts must be >= 1, got {experts}")
    moe_layer_pattern(c.moe_layer_freq, c.num_layers)
    _need(
        not c.add_bias_linear,
        "--num-experts needs --disable-bias-linear: expert and router biases are not built here",
    )
    _need(1 <= topk <= experts, f"--moe-router-topk ({topk}) must be between 1 and --num-experts ({experts})")
    _need(c.moe_ffn_hidden_size >= 1, f"--moe-ffn-hidden-size must be >= 1, got {c.moe_ffn_hidden_size}")
    _need(
        c.moe_router_score_function in SCORE_FUNCTIONS,
        f"--moe-router-score-function must be one of {', '.join(SCORE_FUNCTIONS)}, got {c.moe_router_score_function!r}",
    )
    _need(
        c.moe_router_load_balancing_type in LOAD_BALANCING_TYPES,
        f"--moe-router-load-balancing-type must be one of {', '.join(LOAD_BALANCING_TYPES)} "
        f"(sinkhorn and global_aux_loss are not built), got {c.moe_router_load_balancing_type!r}",
    )
    _need(
        not (topk == 1 and c.moe_router_score_function == "softmax" and not c.moe_router_pre_softmax),
        "--moe-router-topk 1 with the softmax score function needs --moe-router-pre-softmax "
        "(a softmax over the one selected logit has zero gradient)",
    )
    _need(
        not c.moe_router_enable_expert_bias or c.moe_router_score_function == "sigmoid",
        "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid",
    )
    _need(c.moe_aux_loss_coeff >= 0, f"--moe-aux-loss-coeff must be >= 0, got {c.moe_aux_loss_coeff}")
    _need(
        c.moe_z_loss_coeff is None or c.moe_z_loss_coeff >= 0,
        f"--moe-z-loss-coeff must be >= 0, got {c.moe_z_loss_coeff}",
    )
    _need(c.moe_router_dtype in ROUTER_DTYPES, f"--moe-router-dtype must be fp32 or fp64, got {c.moe_router_dtype!r}")
    _need(
        c.moe_token_dispatcher_type in DISPATCHERS,
        f"--moe-token-dispatcher-type must be one of {', '.join(DISPATCHERS)} (flex is not built), "
        f"got {c.moe_token_dispatcher_type!r}",
    )
    _validate_groups(c)
    _validate_capacity(c)
    _validate_shared_expert(c)
    _validate_parallel(c)


def _validate_groups(c) -> None:
    groups, group_topk = c.moe_router_num_groups, c.moe_router_group_topk
    if groups is None and group_topk is None:
        return
    _need(
        groups is not None and group_topk is not None,
        "group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk",
    )
    _need(
        groups >= 1 and c.num_moe_experts % groups == 0,
        f"--num-experts ({c.num_moe_experts}) must be divisible by --moe-router-num-groups ({groups})",
    )
    _need(
        1 <= group_topk <= groups,
        f"--moe-router-group-topk ({group_topk}) must be between 1 and --moe-router-num-groups ({groups})",
    )
    per_group = c.moe_router_topk // group_topk
    _need(
        1 <= per_group <= c.num_moe_experts // groups,
        f"--moe-router-topk ({c.moe_router_topk}) / --moe-router-group-topk ({group_topk}) experts are scored per "
        f"group: it must be between 1 and the {c.num_moe_experts // groups} experts of a group",
    )


def _validate_capacity(c) -> None:
    factor = c.moe_expert_capacity_factor
    _need(
        c.moe_token_drop_policy in DROP_POLICIES,
        f"--moe-token-drop-policy must be one of {', '.join(DROP_POLICIES)}, got {c.moe_token_drop_policy!r}",
    )
    _need(factor is None or factor > 0, f"--moe-expert-capacity-factor must be > 0, got {factor}")
    _need(
        not c.moe_pad_expert_input_to_capacity or factor is not None,
        "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor",
    )


def _validate_shared_expert(c) -> None:
    size = c.moe_shared_expert_intermediate_size
    _need(size is None or size >= 1, f"--moe-shared-expert-intermediate-size must be >= 1, got {size}")
    _need(
        not c.moe_shared_expert_gate or size is not None,
        "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size",
    )
    tp = c.tensor_model_parallel_size
    _need(
        size is None or size % tp == 0,
        f"--moe-shared-expert-intermediate-size ({size}) is not divisible by --tensor-model-parallel-size ({tp})",
    )


def _validate_parallel(c) -> None:
    tp, ep, etp = c.tensor_model_parallel_size, c.expert_model_parallel_size, c.expert_tensor_parallel_size
    _need(
        tp == 1 or c.sequence_parallel,
        f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel, as in Megatron",
    )
    _need(ep >= 1, f"--expert-model-parallel-size must be >= 1, got {ep}")
    _need(
        c.num_moe_experts % ep == 0,
        f"--num-experts ({c.num_moe_experts}) must be divisible by --expert-model-parallel-size ({ep})",
    )
    _need(etp >= 1, f"--expert-tensor-parallel-size must be >= 1, got {etp}")
    _need(
        c.moe_ffn_hidden_size % etp == 0,
        f"--moe-ffn-hidden-size ({c.moe_ffn_hidden_size}) is not divisible by --expert-tensor-parallel-size ({etp})",
    )
