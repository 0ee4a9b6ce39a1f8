"""Megatron-style command line -> typed config dataclasses. Nothing else reads argparse.

Each flag group lives in its own module of this package with the function that turns it into
a config; this module composes them, holds the GPT/Llama defaults and validates the whole.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from megatron.data.config import DataConfig
from megatron.data.tokenizers import build_tokenizer
from megatron.training.arguments.checkpoint import (
    add_checkpoint_arguments,
    checkpoint_config_from_args,
    checkpoint_notes,
)
from megatron.training.arguments.data import add_data_arguments, data_config_from_args
from megatron.training.arguments.evaluation import add_eval_arguments, eval_config_from_args
from megatron.training.arguments.fp8 import add_fp8_arguments, fp8_notes, fp8_recipe_from_args
from megatron.training.arguments.logging import add_logging_arguments, logging_config_from_args
from megatron.training.arguments.megatron_flags import (
    add_no_op_arguments,
    no_op_notes,
    refuse_out_of_scope,
    strip_fusion_toggles,
)
from megatron.training.arguments.model import (
    ATTENTION_BACKENDS,
    add_model_arguments,
    cross_entropy_notes,
    transformer_config_from_args,
)
from megatron.training.arguments.moe import add_moe_arguments, moe_notes, refuse_moe_checkpoints
from megatron.training.arguments.offload import add_offload_arguments, offload_config_from_args
from megatron.training.arguments.optimizer import (
    DEFAULT_LR,
    add_optimizer_arguments,
    decoupled_schedule_from_args,
    lr_schedule_from_args,
    optimizer_config_from_args,
)
from megatron.training.arguments.parallel import add_parallel_arguments
from megatron.training.arguments.training import add_training_arguments, training_config_from_args
from megatron.training.config import RunConfig, parallel_config_from_args

GPT_DEFAULTS = dict(
    normalization="LayerNorm",
    position_embedding_type="learned_absolute",
    swiglu=False,
    disable_bias_linear=False,
    untie_embeddings_and_output_weights=False,
    attention_dropout=0.1,
    hidden_dropout=0.1,
)
LLAMA_DEFAULTS = dict(
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    disable_bias_linear=True,
    untie_embeddings_and_output_weights=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


class ArgumentError(ValueError):
    """A bad command line; the entry point prints it as one line and exits 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ArgumentError(message)


def _data_flags(p):
    p.add_argument_group("mock data").add_argument(
        "--mock-data", action="store_true", help="synthetic sequences (with --vocab-size) instead of --data-path"
    )
    add_data_arguments(p)
    add_eval_arguments(p)


def build_parser(defaults: dict, prog: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="Megatron-style GPT/Llama pre-training")
    add_model_arguments(parser)
    add_moe_arguments(parser)
    add_fp8_arguments(parser)
    add_parallel_arguments(parser)
    add_training_arguments(parser)
    _data_flags(parser)
    add_optimizer_arguments(parser)
    add_offload_arguments(parser)
    add_logging_arguments(parser)
    add_checkpoint_arguments(parser)
    add_no_op_arguments(parser)
    parser.set_defaults(**defaults)
    return parser


def _refuse_unsupported_resets(args) -> None:
    """--reset-position-ids/--reset-attention-mask need documents (real data). The document mask
    is an explicit [b, 1, s, s] mask for torch's SDPA: the Triton flash kernel has no document
    boundaries, and a cp rank's two chunks are not one contiguous sequence."""
    for flag, value in (
        ("--reset-position-ids", args.reset_position_ids),
        ("--reset-attention-mask", args.reset_attention_mask),
    ):
        if value and args.mock_data:
            raise ArgumentError(f"{flag} needs --data-path: mock data has no documents")
    if not args.reset_attention_mask:
        return
    if ATTENTION_BACKENDS[args.attention_backend] == "triton":
        raise ArgumentError(
            "--reset-attention-mask needs --attention-backend auto or torch: "
            "the Triton flash kernel has no document boundaries"
        )
    if args.context_parallel_size > 1:
        raise ArgumentError("--reset-attention-mask is not supported with --context-parallel-size > 1; leave one out")


def _data_config(args) -> DataConfig | None:
    """None for --mock-data; else the validated data flags. A real tokenizer sets the model's
    vocabulary (--vocab-size is only for mock data and NullTokenizer); so does a --tokenizer-type
    given with --mock-data, as in Megatron-LM (NullTokenizer: --vocab-size + 1 ids)."""
    _refuse_unsupported_resets(args)
    if args.mock_data:
        if args.data_path or args.train_data_path:
            raise ArgumentError("give either --mock-data or --data-path/--train-data-path, not both")
        if args.tokenizer_type is not None:
            args.vocab_size = build_tokenizer(
                tokenizer_type=args.tokenizer_type,
                vocab_file=args.vocab_file,
                merge_file=args.merge_file,
                tokenizer_model=args.tokenizer_model,
                vocab_size=args.vocab_size,
            ).vocab_size
        if args.vocab_size is None or args.vocab_size < 2:
            raise ArgumentError(f"--mock-data needs --vocab-size >= 2, got {args.vocab_size}")
        return None
    if not args.data_path and not args.train_data_path:
        raise ArgumentError("no training data: pass --data-path with a tokenizer, or --mock-data with --vocab-size")
    data = data_config_from_args(args)
    args.vocab_size = build_tokenizer(**data.tokenizer_args()).vocab_size
    return data


def parse_run_config(argv: list[str], defaults: dict, world_size: int, prog: str | None = None) -> RunConfig:
    """Parse and validate the whole command line. Raises ArgumentError / ValueError with one line."""
    refuse_out_of_scope(argv)
    argv, fusion_toggles = strip_fusion_toggles(argv)
    args = build_parser(defaults, prog).parse_args(argv)
    data = _data_config(args)
    parallel = parallel_config_from_args(args, world_size)
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    model = dataclasses.replace(
        transformer_config_from_args(args, parallel, dtype), fp8=fp8_recipe_from_args(args, parallel)
    )
    parallel.validate_layers(model.num_layers)
    training = training_config_from_args(args, parallel.dp)
    schedule = lr_schedule_from_args(args, training)
    notes = no_op_notes(args, fusion_toggles)
    if args.lr is None:
        notes.insert(0, f"> note: --lr not given: using {DEFAULT_LR} (Megatron has no default learning rate)")
    notes += moe_notes(model) + cross_entropy_notes(args) + fp8_notes(model.fp8)
    checkpoint = checkpoint_config_from_args(args)
    notes += checkpoint_notes(checkpoint)
    refuse_moe_checkpoints(model, checkpoint, parallel)
    optimizer = dataclasses.replace(optimizer_config_from_args(args), offload=offload_config_from_args(args))
    return RunConfig(
        model=model,
        optimizer=optimizer,
        parallel=parallel,
        training=training,
        sequence_parallel_requested=args.sequence_parallel,
        checkpoint=checkpoint,
        lr_schedule=schedule,
        decoupled_lr_schedule=decoupled_schedule_from_args(args, schedule),
        logging=logging_config_from_args(args),
        notes=notes,
        data=data,
        evaluation=eval_config_from_args(args),
    )
