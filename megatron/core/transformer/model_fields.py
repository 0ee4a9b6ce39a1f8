"""One record per model option: its command-line flag, its TransformerConfig field, what a
different value does to a checkpoint, and its Hugging Face config key.

The checkpoint metadata (which fields are saved), the resume / fine-tune compatibility
check, the Hugging Face exporter (which fields it must represent or refuse) and the
converter's printed command line all read `MODEL_FIELDS`; a new model option is declared
here once. What a different value means for a saved model (`kind`):

- TENSORS: the set or the shapes of the stored tensors differ (resume and fine-tune refuse).
- MEANING: the same tensors compute another function (e.g. norms that scale by 1 + weight):
  resume and fine-tune refuse, since the weights would silently mean something else.
- CONTEXT: how positions are encoded (rotary base, rope scaling): a resume refuses, a
  --finetune may change it (context extension) and says so in one note line.
- RECORDED: kept for converters (sequence length, init std), never checked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TENSORS, MEANING, CONTEXT, RECORDED = "tensors", "meaning", "context", "recorded"


def _always(args: dict) -> bool:
    return True


def _rope(args: dict) -> bool:
    return args.get("position_embedding_type") == "rope"


def _rope_scaled(args: dict) -> bool:
    return _rope(args) and bool(args.get("rope_scaling"))


def _learned_positions(args: dict) -> bool:
    return args.get("position_embedding_type") == "learned_absolute"


def _moe(args: dict) -> bool:
    return args.get("num_moe_experts") is not None


def _moe_capacity(args: dict) -> bool:
    return _moe(args) and args.get("moe_expert_capacity_factor") is not None


# Megatron-LM's argparse destinations that are not the flag's name (--disable-bias-linear stores
# add_bias_linear; its rope scaling switch is --use-rope-scaling)
_MEGATRON_ARGS = {"add_bias_linear": "add_bias_linear", "rope_scaling": "use_rope_scaling"}


@dataclass(frozen=True)
class ModelField:
    """`name`: the TransformerConfig attribute; `flag`: the command-line flag (for a boolean, the switch
    that turns it on, or off when `inverted`); `hf_key`: the Hugging Face config key (Llama family)
    holding the same value, None where the exporter represents it otherwise (architecture, tensor
    transform) or refuses; `applies`: whether the field changes anything for a model (rope fields
    only with rotary positions, the position table's size only with learned positions)."""

    name: str
    kind: str
    flag: str
    hf_key: str | None = None
    inverted: bool = False
    applies: Callable[[dict], bool] = _always

    @property
    def megatron_arg(self) -> str:
        """The name under which Megatron-LM's `args` (a torch_dist checkpoint's common.pt) hold it."""
        return _MEGATRON_ARGS.get(self.name, self.flag[2:].replace("-", "_"))

    def describe(self, value: Any) -> str:
        """The value as a user passes it: a switch is 'set' or 'not set'."""
        if isinstance(value, bool):
            return "set" if value != self.inverted else "not set"
        if isinstance(value, list):  # --moe-layer-freq's pattern, one shell word
            return "[" + ",".join(map(str, value)) + "]"
        return f"{value:g}" if isinstance(value, float) else str(value)

    def command_line(self, value: Any) -> list[str]:
        """The flags that give `value` (nothing for a switch left off)."""
        if isinstance(value, bool):
            return [self.flag] if value != self.inverted else []
        return [self.flag, self.describe(value)]


MODEL_FIELDS: tuple[ModelField, ...] = (
    ModelField("num_layers", TENSORS, "--num-layers", "num_hidden_layers"),
    ModelField("hidden_size", TENSORS, "--hidden-size", "hidden_size"),
    ModelField("ffn_hidden_size", TENSORS, "--ffn-hidden-size", "intermediate_size"),
    ModelField("num_attention_heads", TENSORS, "--num-attention-heads", "num_attention_heads"),
    ModelField("num_query_groups", TENSORS, "--num-query-groups", "num_key_value_heads"),
    ModelField("kv_channels", TENSORS, "--kv-channels", "head_dim"),
    ModelField("vocab_size", TENSORS, "--vocab-size", "vocab_size"),
    ModelField("position_embedding_type", TENSORS, "--position-embedding-type"),
    ModelField(
        "max_position_embeddings",
        TENSORS,
        "--max-position-embeddings",
        "max_position_embeddings",
        applies=_learned_positions,
    ),
    ModelField("normalization", TENSORS, "--normalization"),
    ModelField("swiglu", TENSORS, "--swiglu"),
    ModelField("add_bias_linear", TENSORS, "--disable-bias-linear", inverted=True),
    ModelField("add_qkv_bias", TENSORS, "--add-qkv-bias"),
    ModelField("qk_layernorm", TENSORS, "--qk-layernorm"),
    ModelField("untie_embeddings_and_output_weights", TENSORS, "--untie-embeddings-and-output-weights"),
    ModelField("layernorm_zero_centered_gamma", MEANING, "--apply-layernorm-1p"),
    ModelField("norm_epsilon", MEANING, "--norm-epsilon", "rms_norm_eps"),
    ModelField("rotary_interleaved", MEANING, "--rotary-interleaved", applies=_rope),
    ModelField("rotary_percent", MEANING, "--rotary-percent", applies=_rope),
    ModelField("rotary_base", CONTEXT, "--rotary-base", "rope_theta", applies=_rope),
    ModelField("rope_scaling", CONTEXT, "--rope-scaling", applies=_rope),
    ModelField("rope_scaling_factor", CONTEXT, "--rope-scaling-factor", applies=_rope_scaled),
    ModelField("num_moe_experts", TENSORS, "--num-experts", applies=_moe),
    ModelField("moe_layer_freq", TENSORS, "--moe-layer-freq", applies=_moe),
    ModelField("moe_ffn_hidden_size", TENSORS, "--moe-ffn-hidden-size", applies=_moe),
    ModelField("moe_shared_expert_intermediate_size", TENSORS, "--moe-shared-expert-intermediate-size", applies=_moe),
    ModelField("moe_shared_expert_gate", TENSORS, "--moe-shared-expert-gate", applies=_moe),
    ModelField("moe_router_enable_expert_bias", TENSORS, "--moe-router-enable-expert-bias", applies=_moe),
    ModelField("moe_router_topk", MEANING, "--moe-router-topk", applies=_moe),
    ModelField("moe_router_score_function", MEANING, "--moe-router-score-function", applies=_moe),
    ModelField("moe_router_pre_softmax", MEANING, "--moe-router-pre-softmax", applies=_moe),
    ModelField("moe_router_topk_scaling_factor", MEANING, "--moe-router-topk-scaling-factor", applies=_moe),
    ModelField("moe_router_num_groups", MEANING, "--moe-router-num-groups", applies=_moe),
    ModelField("moe_router_group_topk", MEANING, "--moe-router-group-topk", applies=_moe),
    ModelField("moe_expert_capacity_factor", MEANING, "--moe-expert-capacity-factor", applies=_moe),
    ModelField("moe_token_drop_policy", MEANING, "--moe-token-drop-policy", applies=_moe_capacity),
    ModelField("seq_length", RECORDED, "--seq-length"),
    ModelField("init_method_std", RECORDED, "--init-method-std", "initializer_range"),
)

# TransformerConfig fields that never change what a saved model computes: the parallel layout,
# kernels and recomputation (same function, other schedule), dropout and initialisation (training
# only), the weights' dtype (converted on load); and the vocabulary padding, which follows tp as in
# Megatron (a load reads the rows the saved and the new padding share, and says so in one line). A
# new field belongs either here or in MODEL_FIELDS (tests/unit/test_model_fields.py checks).
RUNTIME_FIELDS = frozenset(
    {
        "params_dtype",
        "tensor_model_parallel_size",
        "sequence_parallel",
        "context_parallel_size",
        "cp_comm_type",
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
        "attention_backend",
        "normalization_impl",
        "rope_impl",
        "swiglu_impl",
        "kernel_impl",
        "gradient_accumulation_fusion",
        "cross_entropy_loss_fusion",
        "cross_entropy_impl",
        "fp8",  # how the linear layers' GEMMs run; its amax state is saved apart (`_fp8_state`)
        "attention_dropout",
        "hidden_dropout",
        "init_method",
        "make_vocab_size_divisible_by",
        # MoE training only: auxiliary losses and bias updates (gradients), routing precision, padding of
        # capacity-limited expert inputs (padding rows have weight 0), how experts run and where they live
        "moe_router_load_balancing_type",
        "moe_aux_loss_coeff",
        "moe_z_loss_coeff",
        "moe_router_bias_update_rate",
        "moe_router_dtype",
        "moe_pad_expert_input_to_capacity",
        "moe_grouped_gemm",
        "moe_token_dispatcher_type",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
    }
)


def model_record(config) -> dict:
    """Every recorded field of a TransformerConfig (or any object with those attributes)."""
    return {field.name: getattr(config, field.name) for field in MODEL_FIELDS}


@dataclass(frozen=True)
class FieldDifference:
    field: ModelField
    saved: Any
    wanted: Any

    def sentence(self) -> str:
        """'saved with --num-layers 2, the flags give 4' / 'saved with --qk-layernorm, the flags leave it out'."""
        flag = self.field.flag
        if isinstance(self.saved, bool):
            if self.field.describe(self.saved) == "set":
                return f"saved with {flag}, the flags leave it out"
            return f"saved without {flag}, the flags give it"
        return f"saved with {flag} {self.field.describe(self.saved)}, the flags give {self.field.describe(self.wanted)}"


def differences(saved: dict, wanted: dict) -> tuple[list[FieldDifference], list[ModelField]]:
    """(the checked fields whose values differ, the checked fields the saved record lacks: written
    before they were recorded). A field is compared where it applies to either model."""
    differing, unknown = [], []
    for field in MODEL_FIELDS:
        if field.kind == RECORDED or not (field.applies(saved) or field.applies(wanted)):
            continue
        if field.name not in saved:
            unknown.append(field)
        elif saved[field.name] != wanted[field.name]:
            differing.append(FieldDifference(field, saved[field.name], wanted[field.name]))
    return differing, unknown
