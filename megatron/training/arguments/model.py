"""Megatron's model flags -> TransformerConfig. Nothing else reads these flags."""

from __future__ import annotations

import argparse

from megatron.core.transformer.config import TransformerConfig
from megatron.training.arguments.moe import moe_fields_from_args
from megatron.training.arguments.parallel import cp_comm_type_from_args

# Megatron's --attention-backend choices onto our paths (the start-up log says which one runs): its
# fused kernels (flash, cuDNN "fused") -> our flash kernel where it can run, the torch path elsewhere
# (so a GPU script also starts on CPU); "unfused"/"local" -> megatron-core's unfused DotProductAttention
# (its local spec's arithmetic and rounding). Our own "triton" forces the kernel, "torch" torch's SDPA.
ATTENTION_BACKENDS = {
    "auto": "auto",
    "triton": "triton",
    "torch": "torch",
    "flash": "auto",
    "fused": "auto",
    "unfused": "unfused",
    "local": "unfused",
}


def add_model_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("model")
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
    g.add_argument(
        "--no-position-embedding", action="store_true", help="Megatron's alias of --position-embedding-type none"
    )
    g.add_argument(
        "--use-rotary-position-embeddings",
        action="store_true",
        help="Megatron's alias of --position-embedding-type rope",
    )
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--rotary-percent", type=float, default=1.0, help="share of each head's channels that rotate")
    g.add_argument("--rotary-interleaved", action="store_true", help="rotate channel pairs (2i, 2i+1), not halves")
    g.add_argument(
        "--rope-scaling",
        "--use-rope-scaling",
        action="store_true",
        help="Llama-3.1 rotary frequency scaling (--use-rope-scaling: Megatron's name)",
    )
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument(
        "--apply-layernorm-1p",
        action="store_true",
        help="norm weights start at 0 and scale by (1 + weight) (LayerNorm and RMSNorm)",
    )
    g.add_argument("--qk-layernorm", action="store_true", help="normalise each head's query and key")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true", help="QKV bias even with --disable-bias-linear (Qwen)")
    g.add_argument("--attention-dropout", type=float)
    g.add_argument("--hidden-dropout", type=float)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument(
        "--init-method-xavier-uniform",
        action="store_true",
        help="every weight matrix (linear layers, embeddings, output layer) uniform in "
        "±sqrt(6 / (fan_in + fan_out)) of the full tensor instead of normal",
    )
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--vocab-size", type=int)
    g.add_argument("--recompute-granularity", choices=["full", "selective"])
    g.add_argument(
        "--recompute-activations", action="store_true", help="Megatron's alias of --recompute-granularity selective"
    )
    g.add_argument("--recompute-method", choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int)
    g.add_argument(
        "--attention-backend",
        choices=list(ATTENTION_BACKENDS),
        default="auto",
        help="flash/fused: our Triton flash kernel where it can run (as auto); "
        "unfused/local: megatron-core's unfused attention",
    )
    g.add_argument("--normalization-impl", choices=["auto", "triton", "torch"], default="auto")
    g.add_argument(
        "--kernel-impl",
        choices=["auto", "triton", "torch"],
        default="auto",
        help="every op whose own switch is left at auto: triton (each Triton kernel where it takes the "
        "shape; on CPU under TRITON_INTERPRET=1), torch (each torch path), auto (Triton where it runs)",
    )
    for on, off, dest, what in (
        ("--apply-rope-fusion", "--no-rope-fusion", "apply_rope_fusion", "RoPE of q and k"),
        ("--bias-swiglu-fusion", "--no-bias-swiglu-fusion", "bias_swiglu_fusion", "bias + SwiGLU"),
    ):
        g.add_argument(on, dest=dest, action="store_true", default=True, help=f"fused {what} (the default)")
        g.add_argument(off, dest=dest, action="store_false", help=f"{what} as plain torch ops")
    g.add_argument(
        "--gradient-accumulation-fusion",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="linear layers add their weight gradients straight into the fp32 main_grad buffer "
        "(one addmm, no weight-gradient tensor; bf16/fp16 products summed in fp32) (default on, as in Megatron)",
    )
    g.add_argument(
        "--cross-entropy-loss-fusion",
        action="store_true",
        help="the output layer and the vocab-parallel cross-entropy in one pass over token chunks: "
        "a microbatch's logits are never stored whole (docs/kernels.md)",
    )
    g.add_argument(
        "--cross-entropy-fusion-impl",
        choices=["native", "te"],
        help="native (default): our fused pass; te: Transformer Engine's is not used here, ours runs "
        "(the same losses; noted at start-up)",
    )
    return parser


def cross_entropy_notes(args) -> list[str]:
    """Start-up notes for --cross-entropy-fusion-impl: 'te' runs our fused pass; without
    --cross-entropy-loss-fusion it does nothing, as in Megatron."""
    impl = args.cross_entropy_fusion_impl
    if impl is not None and not args.cross_entropy_loss_fusion:
        return [f"> note: --cross-entropy-fusion-impl {impl} changes nothing without --cross-entropy-loss-fusion"]
    if impl == "te":
        return [
            "> note: --cross-entropy-fusion-impl te: Transformer Engine is not used here; our fused output "
            "layer + cross-entropy runs instead (the same losses, and the logits are never stored whole)"
        ]
    return []


def _position_embedding_type(args) -> str:
    aliases = [
        t for flag, t in ((args.no_position_embedding, "none"), (args.use_rotary_position_embeddings, "rope")) if flag
    ]
    if len(aliases) > 1:
        raise ValueError("--no-position-embedding and --use-rotary-position-embeddings contradict each other")
    return aliases[0] if aliases else args.position_embedding_type


def _recompute_granularity(args) -> str | None:
    if args.recompute_activations:
        if args.recompute_granularity not in (None, "selective"):
            raise ValueError(
                f"--recompute-activations (selective) contradicts --recompute-granularity {args.recompute_granularity}"
            )
        return "selective"
    return args.recompute_granularity


def transformer_config_from_args(args, parallel, params_dtype) -> TransformerConfig:
    """One ValueError line naming the flag for anything invalid."""
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ValueError("--num-query-groups needs --group-query-attention")
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=(args.num_query_groups or 1) if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        vocab_size=args.vocab_size,
        seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        position_embedding_type=_position_embedding_type(args),
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        rotary_interleaved=args.rotary_interleaved,
        rope_scaling=args.rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        normalization=args.normalization,
        norm_epsilon=args.norm_epsilon,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        qk_layernorm=args.qk_layernorm,
        swiglu=args.swiglu,
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std,
        init_method="xavier_uniform" if args.init_method_xavier_uniform else "normal",
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        params_dtype=params_dtype,
        tensor_model_parallel_size=parallel.tp,
        sequence_parallel=args.sequence_parallel and parallel.tp > 1,
        context_parallel_size=parallel.cp,
        cp_comm_type=cp_comm_type_from_args(args),
        recompute_granularity=_recompute_granularity(args),
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        attention_backend=ATTENTION_BACKENDS[args.attention_backend],
        normalization_impl=args.normalization_impl,
        rope_impl="auto" if args.apply_rope_fusion else "torch",
        swiglu_impl="auto" if args.bias_swiglu_fusion else "torch",
        kernel_impl=args.kernel_impl,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        **moe_fields_from_args(args),
    )
