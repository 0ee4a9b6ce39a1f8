"""Megatron-style command line -> typed config dataclasses. Nothing else reads argparse."""
from __future__ import annotations

import argparse

import torch

from megatron.core.optimizer.config import OptimizerConfig
from megatron.core.transformer.config import TransformerConfig
from megatron.training.checkpoint_args import add_checkpoint_arguments, checkpoint_config_from_args
from megatron.training.config import ParallelConfig, RunConfig, TrainingConfig

GPT_DEFAULTS = dict(normalization="LayerNorm", position_embedding_type="learned_absolute", swiglu=False,
                    disable_bias_linear=False, untie_embeddings_and_output_weights=False,
                    attention_dropout=0.1, hidden_dropout=0.1)
LLAMA_DEFAULTS = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                      disable_bias_linear=True, untie_embeddings_and_output_weights=True,
                      attention_dropout=0.0, hidden_dropout=0.0)


class ArgumentError(ValueError):
    """A bad command line; the entry point prints it as one line and exits 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ArgumentError(message)


def _model_flags(p):
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int)
    g.add_argument("--kv-channels", type=int)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"])
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--attention-dropout", type=float)
    g.add_argument("--hidden-dropout", type=float)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--vocab-size", type=int)
    g.add_argument("--recompute-granularity", choices=["full", "selective"])
    g.add_argument("--recompute-method", choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int)
    g.add_argument("--attention-backend", choices=["auto", "triton", "torch"], default="auto")
    g.add_argument("--normalization-impl", choices=["auto", "triton", "torch"], default="auto")


def _parallel_flags(p):
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--cp-comm-type", choices=["p2p", "all_gather"], default="p2p",
                   help="context-parallel attention: ring of K/V blocks (p2p) or all-gather of K/V")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int)
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard fp32 master weights and Adam moments over dp x cp (ZeRO-1/2): gradients are "
                        "reduce-scattered and updated parameters all-gathered, bucket by bucket")
    g.add_argument("--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=True,
                   help="reduce each gradient bucket as soon as backward completes it (default on)")
    g.add_argument("--overlap-param-gather", action=argparse.BooleanOptionalAction, default=False,
                   help="with --use-distributed-optimizer: start the parameter all-gathers at the end of the "
                        "step and wait for each bucket just before the next forward first uses it")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"])
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--ddp-bucket-size", type=int,
                   help="elements per bucket (memory chunk) of the parameter and gradient buffers "
                        "(default max(40M, 1M x dp x cp))")


def _training_flags(p):
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-path", nargs="*")
    g.add_argument("--tensorboard-dir")
    g.add_argument("--device-memory-gb", type=float,
                   help="device memory to check the memory estimate against (default: the CUDA device's)")
    g.add_argument("--skip-memory-check", action="store_true",
                   help="start even when the memory estimate exceeds device memory")
    o = p.add_argument_group("optimizer and precision")
    o.add_argument("--lr", type=float, default=1e-4)
    o.add_argument("--min-lr", type=float, default=0.0)
    o.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    o.add_argument("--lr-warmup-iters", type=int, default=0)
    o.add_argument("--lr-decay-iters", type=int)
    o.add_argument("--weight-decay", type=float, default=0.01)
    o.add_argument("--adam-beta1", type=float, default=0.9)
    o.add_argument("--adam-beta2", type=float, default=0.999)
    o.add_argument("--adam-eps", type=float, default=1e-8)
    o.add_argument("--clip-grad", type=float, default=1.0)
    o.add_argument("--bf16", action="store_true")
    o.add_argument("--fp16", action="store_true")
    o.add_argument("--loss-scale", type=float)
    o.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    o.add_argument("--min-loss-scale", type=float, default=1.0)
    o.add_argument("--loss-scale-window", type=int, default=1000)
    o.add_argument("--hysteresis", type=int, default=2)


def build_parser(defaults: dict, prog: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="Megatron-style GPT/Llama pre-training")
    _model_flags(parser)
    _parallel_flags(parser)
    _training_flags(parser)
    add_checkpoint_arguments(parser)
    parser.set_defaults(**defaults)
    return parser


def _refuse_unbuilt(args) -> None:
    """Flags whose feature has not been built yet are refused, never silently ignored."""
    unbuilt = [
        (bool(args.data_path), "--data-path: indexed datasets are not built yet; use --mock-data"),
    ]
    for condition, message in unbuilt:
        if condition:
            raise ArgumentError(message)
    if not args.mock_data:
        raise ArgumentError("no training data: pass --mock-data (with --vocab-size)")
    if args.vocab_size is None or args.vocab_size < 2:
        raise ArgumentError(f"--mock-data needs --vocab-size >= 2, got {args.vocab_size}")


def parse_run_config(argv: list[str], defaults: dict, world_size: int, prog: str | None = None) -> RunConfig:
    """Parse and validate the whole command line. Raises ArgumentError / ValueError with one line."""
    args = build_parser(defaults, prog).parse_args(argv)
    _refuse_unbuilt(args)
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ArgumentError("--num-query-groups needs --group-query-attention")
    parallel = ParallelConfig.from_args(args, world_size)
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    model = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=(args.num_query_groups or 1) if args.group_query_attention else None,
        kv_channels=args.kv_channels, vocab_size=args.vocab_size, seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        normalization=args.normalization, norm_epsilon=args.norm_epsilon, swiglu=args.swiglu,
        add_bias_linear=not args.disable_bias_linear,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        params_dtype=dtype, tensor_model_parallel_size=parallel.tp,
        sequence_parallel=args.sequence_parallel and parallel.tp > 1, context_parallel_size=parallel.cp,
        cp_comm_type=args.cp_comm_type,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers, attention_backend=args.attention_backend,
        normalization_impl=args.normalization_impl)
    parallel.validate_layers(model.num_layers)
    optimizer = OptimizerConfig(
        lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style, lr_warmup_iters=args.lr_warmup_iters,
        lr_decay_iters=args.lr_decay_iters or args.train_iters, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        fp16=args.fp16, bf16=args.bf16, loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis)
    training = TrainingConfig.from_args(args, parallel.dp)
    return RunConfig(model=model, optimizer=optimizer, parallel=parallel, training=training,
                     sequence_parallel_requested=args.sequence_parallel, checkpoint=checkpoint_config_from_args(args))
