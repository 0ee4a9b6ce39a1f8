"""Our model fields <-> the arguments a Megatron-LM checkpoint records (`common.pt`'s `args`).

One record per TransformerConfig field: Megatron-LM's argparse name, and whether the stored
tensors' set or shapes depend on it (the others change only what the model computes). A
Megatron-LM checkpoint is refused when any of these differs from our flags, and when it was
saved with a feature this framework does not build (`UNSUPPORTED`). Written the other way,
the same record gives the `args` our Megatron-format checkpoints carry.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MegatronArg:
    field: str             # our TransformerConfig field
    megatron: str          # Megatron-LM's argparse destination
    changes_tensors: bool  # the stored tensors' set or shapes depend on it


FIELDS = (
    MegatronArg("num_layers", "num_layers", True),
    MegatronArg("hidden_size", "hidden_size", True),
    MegatronArg("ffn_hidden_size", "ffn_hidden_size", True),
    MegatronArg("num_attention_heads", "num_attention_heads", True),
    MegatronArg("num_query_groups", "num_query_groups", True),
    MegatronArg("kv_channels", "kv_channels", True),
    MegatronArg("position_embedding_type", "position_embedding_type", True),
    MegatronArg("normalization", "normalization", True),
    MegatronArg("swiglu", "swiglu", True),
    MegatronArg("add_bias_linear", "add_bias_linear", True),
    MegatronArg("add_qkv_bias", "add_qkv_bias", True),
    MegatronArg("qk_layernorm", "qk_layernorm", True),
    MegatronArg("untie_embeddings_and_output_weights", "untie_embeddings_and_output_weights", True),
    MegatronArg("norm_epsilon", "norm_epsilon", False),
    MegatronArg("layernorm_zero_centered_gamma", "apply_layernorm_1p", False),
    MegatronArg("rotary_base", "rotary_base", False),
    MegatronArg("rotary_percent", "rotary_percent", False),
    MegatronArg("rotary_interleaved", "rotary_interleaved", False),
    MegatronArg("rope_scaling", "use_rope_scaling", False),
)
# Megatron-LM arguments of models this framework does not build, with the value that means "off"
UNSUPPORTED = {"num_experts": None, "multi_latent_attention": False, "squared_relu": False,
               "mtp_num_layers": None, "heterogeneous_layers_config_path": None}


def megatron_value(args, arg: MegatronArg):
    """The checkpoint's effective value of `arg` (None when the checkpoint does not record it)."""
    if arg.field == "num_query_groups":  # Megatron-LM uses it only with --group-query-attention
        if not hasattr(args, "group_query_attention"):
            return getattr(args, "num_query_groups", None)
        return args.num_query_groups if args.group_query_attention else getattr(args, "num_attention_heads", None)
    if arg.field == "add_qkv_bias":  # the QKV projection has a bias with either flag
        return getattr(args, "add_qkv_bias", False) or getattr(args, "add_bias_linear", False)
    return getattr(args, arg.megatron, None)


def our_value(config, arg: MegatronArg):
    if arg.field == "add_qkv_bias":
        return config.add_qkv_bias or config.add_bias_linear
    return getattr(config, arg.field)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def args_mismatch(args, config) -> str | None:
    """Why a checkpoint saved with Megatron-LM `args` does not fit `config` (one line), or None."""
    for name, off in UNSUPPORTED.items():
        value = getattr(args, name, off)
        if value not in (off, False, None, 0):
            return f"saved with {_flag(name)} {value}: not supported by this framework"
    for arg in FIELDS:
        saved, ours = megatron_value(args, arg), our_value(config, arg)
        if saved is None:
            continue
        if isinstance(ours, float) and isinstance(saved, (int, float)) and not isinstance(saved, bool):
            equal = float(saved) == ours
        else:
            equal = saved == ours
        if not equal:
            return f"saved with {_flag(arg.megatron)} {saved}, the flags give {ours}"
    vocab = getattr(args, "vocab_size", None)
    if vocab is not None and vocab != config.vocab_size:
        return f"saved with --vocab-size {vocab}, the flags give {config.vocab_size}"
    return None


def megatron_args(config, *, iteration: int, consumed_samples: int, tp: int, pp: int,
                  extra: dict) -> argparse.Namespace:
    """The `args` a Megatron-format checkpoint of ours records, under Megatron-LM's names."""
    values = {arg.megatron: getattr(config, arg.field) for arg in FIELDS}
    values.update(UNSUPPORTED)
    values.update(
        group_query_attention=config.num_query_groups != config.num_attention_heads,
        vocab_size=config.vocab_size, padded_vocab_size=config.padded_vocab_size,
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
        max_position_embeddings=config.max_position_embeddings, seq_length=config.seq_length,
        init_method_std=config.init_method_std, attention_dropout=config.attention_dropout,
        hidden_dropout=config.hidden_dropout, params_dtype=config.params_dtype,
        bf16=config.params_dtype == torch.bfloat16, fp16=config.params_dtype == torch.float16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, iteration=iteration,
        consumed_train_samples=consumed_samples, consumed_valid_samples=0, ckpt_format="torch_dist",
        use_dist_ckpt=True, use_distributed_optimizer=False, **extra)
    return argparse.Namespace(**values)


def config_fields(args) -> dict:
    """TransformerConfig keyword arguments of the model a Megatron-LM checkpoint's `args` describe
    (refused, one ValueError line, when it uses a feature this framework does not build). Without
    `args.vocab_size` (a tokenizer's vocabulary) the padded size stands for it."""
    for name, off in UNSUPPORTED.items():
        value = getattr(args, name, off)
        if value not in (off, False, None, 0):
            raise ValueError(f"saved with {_flag(name)} {value}: not supported by this framework")
    fields = {arg.field: value for arg in FIELDS if (value := megatron_value(args, arg)) is not None}
    if fields.get("add_qkv_bias") and fields.get("add_bias_linear"):
        fields["add_qkv_bias"] = False  # implied by the biases of every linear layer
    vocab = getattr(args, "vocab_size", None) or args.padded_vocab_size
    seq = getattr(args, "seq_length", None) or args.max_position_embeddings
    fields.update(vocab_size=vocab, seq_length=seq, max_position_embeddings=args.max_position_embeddings,
                  make_vocab_size_divisible_by=getattr(args, "make_vocab_size_divisible_by", 128),
                  init_method_std=getattr(args, "init_method_std", 0.02),
                  attention_dropout=getattr(args, "attention_dropout", 0.1),
                  hidden_dropout=getattr(args, "hidden_dropout", 0.1))
    return fields
