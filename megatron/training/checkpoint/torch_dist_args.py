"""Our model fields <-> the arguments a Megatron-LM checkpoint records (`common.pt`'s `args`).

The fields are those of the model-field record (megatron.core.transformer.model_fields), each
under its Megatron-LM argparse name (`ModelField.megatron_arg`). A Megatron-LM checkpoint is
refused when a field that changes the stored tensors or their meaning differs from our flags,
and when it was saved with a feature this framework does not build (`UNSUPPORTED`). Written the
other way, the same record gives the `args` our Megatron-format checkpoints carry.
"""

from __future__ import annotations

import argparse

import torch

from megatron.core.transformer.model_fields import MODEL_FIELDS, ModelField, differences, model_record

# Megatron-LM arguments of models this framework does not build, with the value that means "off"
UNSUPPORTED = {
    "multi_latent_attention": False,
    "squared_relu": False,
    "mtp_num_layers": None,
    "heterogeneous_layers_config_path": None,
}


def _null_tokenizer(args) -> bool:
    return getattr(args, "tokenizer_type", None) == "NullTokenizer" and getattr(args, "vocab_size", None) is not None


def megatron_value(args, field: ModelField):
    """The checkpoint's effective value of `field` (None when the checkpoint does not record it). The
    vocabulary is the tokenizer's: Megatron-LM records the --vocab-size it was given, and its
    NullTokenizer has one id more (EOD), as ours has (tests/mcore_oracle/test_null_tokenizer.py)."""
    if field.name == "vocab_size" and _null_tokenizer(args):
        return args.vocab_size + 1
    if field.name == "num_query_groups":  # Megatron-LM uses it only with --group-query-attention
        if not hasattr(args, "group_query_attention"):
            return getattr(args, "num_query_groups", None)
        return args.num_query_groups if args.group_query_attention else getattr(args, "num_attention_heads", None)
    if field.name == "add_qkv_bias":  # the QKV projection has a bias with either flag
        return getattr(args, "add_qkv_bias", False) or getattr(args, "add_bias_linear", False)
    return getattr(args, field.megatron_arg, None)


def _saved_record(args) -> dict:
    return {field.name: value for field in MODEL_FIELDS if (value := megatron_value(args, field)) is not None}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def args_mismatch(args, config) -> str | None:
    """Why a checkpoint saved with Megatron-LM `args` does not fit `config` (one line), or None."""
    for name, off in UNSUPPORTED.items():
        value = getattr(args, name, off)
        if value not in (off, False, None, 0):
            return f"saved with {_flag(name)} {value}: not supported by this framework"
    ours = model_record(config)
    ours["add_qkv_bias"] = config.add_qkv_bias or config.add_bias_linear  # as megatron_value reads it
    differing, _ = differences(_saved_record(args), ours)  # a field older Megatron-LM lacks is not compared
    if not differing:
        return None
    first = differing[0]
    if first.field.name == "vocab_size" and _null_tokenizer(args):
        return (
            f"saved with --tokenizer-type NullTokenizer --vocab-size {args.vocab_size} ({first.saved} ids with EOD), "
            f"the flags give {first.wanted} ids"
        )
    return first.sentence()


def megatron_args(
    config, *, iteration: int, consumed_samples: int, tp: int, pp: int, extra: dict
) -> argparse.Namespace:
    """The `args` a Megatron-format checkpoint of ours records, under Megatron-LM's names."""
    values = {field.megatron_arg: getattr(config, field.name) for field in MODEL_FIELDS}
    values.update(UNSUPPORTED)
    values.update(
        group_query_attention=config.num_query_groups != config.num_attention_heads,
        vocab_size=config.vocab_size,
        padded_vocab_size=config.padded_vocab_size,
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
        max_position_embeddings=config.max_position_embeddings,
        seq_length=config.seq_length,
        init_method_std=config.init_method_std,
        attention_dropout=config.attention_dropout,
        hidden_dropout=config.hidden_dropout,
        params_dtype=config.params_dtype,
        bf16=config.params_dtype == torch.bfloat16,
        fp16=config.params_dtype == torch.float16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        iteration=iteration,
        consumed_train_samples=consumed_samples,
        consumed_valid_samples=0,
        ckpt_format="torch_dist",
        use_dist_ckpt=True,
        use_distributed_optimizer=False,
    )
    values.update(extra)  # the run's own values (learning rates, the distributed optimizer's layout)
    return argparse.Namespace(**values)


def config_fields(args) -> dict:
    """TransformerConfig keyword arguments of the model a Megatron-LM checkpoint's `args` describe
    (refused, one ValueError line, when it uses a feature this framework does not build). Without
    `args.vocab_size` (a tokenizer's vocabulary, see megatron_value) the padded size stands for it."""
    for name, off in UNSUPPORTED.items():
        value = getattr(args, name, off)
        if value not in (off, False, None, 0):
            raise ValueError(f"saved with {_flag(name)} {value}: not supported by this framework")
    fields = _saved_record(args)
    if fields.get("add_qkv_bias") and fields.get("add_bias_linear"):
        fields["add_qkv_bias"] = False  # implied by the biases of every linear layer
    vocab = fields.get("vocab_size") or args.padded_vocab_size
    seq = getattr(args, "seq_length", None) or args.max_position_embeddings
    fields.update(
        vocab_size=vocab,
        seq_length=seq,
        max_position_embeddings=args.max_position_embeddings,
        make_vocab_size_divisible_by=getattr(args, "make_vocab_size_divisible_by", 128),
        init_method_std=getattr(args, "init_method_std", 0.02),
        attention_dropout=getattr(args, "attention_dropout", 0.1),
        hidden_dropout=getattr(args, "hidden_dropout", 0.1),
    )
    return fields
