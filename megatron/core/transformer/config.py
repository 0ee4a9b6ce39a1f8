"""TransformerConfig: the model's shape and numerics, one dataclass for GPT and Llama."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.dispatch import UNFUSED, KernelPaths, kernel_paths
from megatron.core.fp8.recipe import GEMM_MULTIPLE, Fp8Recipe
from megatron.core.tensor_parallel.initialization import RANDOM_KINDS
from megatron.core.transformer.moe.validation import moe_layer_pattern, validate_moe

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_METHODS = (None, "uniform", "block")
KERNEL_IMPLS = ("auto", "triton", "torch")
CP_COMM_TYPES = ("p2p", "all_gather")


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Vocabulary padded to a multiple of divisible_by x tp, as Megatron does (the only place this is computed)."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass
class TransformerConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
    kv_channels: int | None = None
    max_position_embeddings: int | None = None
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0  # share of each head's channels that rotate (--rotary-percent)
    rotary_interleaved: bool = False  # rotate channel pairs (0,1), (2,3).. instead of halves
    rope_scaling: bool = False  # Llama-3.1 frequency scaling (--rope-scaling)
    rope_scaling_factor: float = 8.0
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False  # --apply-layernorm-1p: norms scale by (1 + weight)
    qk_layernorm: bool = False  # normalise each head's query and key before attention
    swiglu: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # bias on the QKV projection even without other biases (Qwen)
    untie_embeddings_and_output_weights: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
    init_method: str = "normal"  # weight matrices: "normal" (init_method_std) or "xavier_uniform"
    make_vocab_size_divisible_by: int = 128
    params_dtype: torch.dtype = torch.float32
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    attention_backend: str = "auto"
    normalization_impl: str = "auto"
    rope_impl: str = "auto"  # "torch" under --no-rope-fusion (megatron-core's unfused rotary)
    swiglu_impl: str = "auto"  # "torch" under --no-bias-swiglu-fusion
    kernel_impl: str = "auto"  # --kernel-impl: the side of every op whose own switch is "auto"
    gradient_accumulation_fusion: bool = True  # linear layers add weight gradients into main_grad themselves
    cross_entropy_loss_fusion: bool = False  # the output layer and the cross-entropy in one chunked pass
    cross_entropy_impl: str = "auto"  # the fused pass's reductions: kernels/cross_entropy.py's impl
    # mixture of experts (megatron-core's names and defaults; moe/validation.py checks them)
    num_moe_experts: int | None = None  # --num-experts: None is a dense model
    moe_layer_freq: int | list = 1  # every n-th layer is MoE, or one 0/1 per layer
    moe_ffn_hidden_size: int | None = None  # each expert's intermediate size (default --ffn-hidden-size)
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False  # sigmoid(x . w) scales the shared expert's output (Qwen2-MoE)
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_dtype: str | None = None  # "fp32": routing computed in fp32 whatever the model dtype
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_grouped_gemm: bool = False  # one grouped GEMM on CUDA; here a loop over the local experts
    moe_token_dispatcher_type: str = "allgather"
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: the tensor-parallel size, as Megatron
    fp8: Fp8Recipe | None = None  # --fp8-format and its recipe flags (megatron/core/fp8/recipe.py); None: no FP8

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            # Megatron's defaults: 4h, or for SwiGLU 2/3 of that rounded down to a multiple of 64
            self.ffn_hidden_size = int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                    f"({self.num_attention_heads}), or give --kv-channels"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.num_moe_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        self.validate()

    def validate(self) -> None:
        def need(condition: bool, message: str):
            if not condition:
                raise ValueError(message)

        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "vocab_size",
            "seq_length",
            "ffn_hidden_size",
            "kv_channels",
            "make_vocab_size_divisible_by",
        ):
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("rotary_base", "norm_epsilon", "init_method_std"):
            need(getattr(self, name) > 0, f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        need(
            self.init_method in RANDOM_KINDS,
            f"init method must be one of {', '.join(RANDOM_KINDS)}, got {self.init_method!r}",
        )
        need(
            self.normalization in NORMALIZATIONS,
            f"--normalization must be one of {', '.join(NORMALIZATIONS)}, got {self.normalization!r}",
        )
        need(
            self.position_embedding_type in POSITION_EMBEDDINGS,
            f"--position-embedding-type must be one of {', '.join(POSITION_EMBEDDINGS)}, "
            f"got {self.position_embedding_type!r}",
        )
        need(
            self.num_attention_heads % self.num_query_groups == 0,
            f"--num-attention-heads ({self.num_attention_heads}) must be divisible by --num-query-groups "
            f"({self.num_query_groups})",
        )
        need(
            self.position_embedding_type != "learned_absolute" or self.max_position_embeddings >= self.seq_length,
            f"--max-position-embeddings ({self.max_position_embeddings}) must be >= --seq-length ({self.seq_length})",
        )
        need(0.0 < self.rotary_percent <= 1.0, f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        need(
            self.position_embedding_type != "rope" or self.rotary_dim % 2 == 0,
            f"rotary embeddings need an even number of rotated channels, got --kv-channels {self.kv_channels} x "
            f"--rotary-percent {self.rotary_percent} = {self.rotary_dim}",
        )
        need(self.rope_scaling_factor >= 1.0, f"--rope-scaling-factor must be >= 1, got {self.rope_scaling_factor}")
        for name in ("attention_dropout", "hidden_dropout"):
            need(0.0 <= getattr(self, name) < 1.0, f"--{name.replace('_', '-')} must be in [0, 1)")
        need(
            self.recompute_granularity in RECOMPUTE_GRANULARITIES,
            f"--recompute-granularity must be full or selective, got {self.recompute_granularity!r}",
        )
        need(
            self.recompute_method in RECOMPUTE_METHODS,
            f"--recompute-method must be uniform or block, got {self.recompute_method!r}",
        )
        if self.recompute_granularity == "full":
            need(
                self.recompute_method is not None,
                "--recompute-granularity full needs --recompute-method uniform or block",
            )
            need(
                (self.recompute_num_layers or 0) >= 1, "--recompute-granularity full needs --recompute-num-layers >= 1"
            )
        else:
            need(self.recompute_method is None, "--recompute-method only applies with --recompute-granularity full")
        impl_fields = (("attention_backend", (*KERNEL_IMPLS, UNFUSED)), ("normalization_impl", KERNEL_IMPLS))
        impl_fields += tuple(
            (name, KERNEL_IMPLS) for name in ("rope_impl", "swiglu_impl", "kernel_impl", "cross_entropy_impl")
        )
        for name, impls in impl_fields:
            need(
                getattr(self, name) in impls,
                f"--{name.replace('_', '-')} must be one of {', '.join(impls)}",
            )
        self._validate_tensor_parallel()
        self._validate_context_parallel()
        validate_moe(self)
        self._validate_fp8_gemms()

    def _validate_fp8_gemms(self) -> None:
        """torch._scaled_mm needs every GEMM dimension divisible by 16: name the layer and the dimension."""
        if self.fp8 is None:
            return
        tp, h = self.tensor_model_parallel_size, self.hidden_size
        qkv = self.num_query_groups * (self.num_attention_heads // self.num_query_groups + 2) * self.kv_channels
        stacked = 2 if self.swiglu else 1
        dims = [
            ("linear_qkv", "input (--hidden-size)", h),
            ("linear_qkv", "output per tp rank", qkv // tp),
            ("linear_proj", "input per tp rank", self.num_attention_heads * self.kv_channels // tp),
            ("linear_fc1", "output per tp rank", stacked * self.ffn_hidden_size // tp),
            ("linear_fc2", "input per tp rank", self.ffn_hidden_size // tp),
        ]
        if self.num_moe_experts is not None:
            etp = self.expert_tensor_parallel_size
            dims.append(("experts' linear_fc2", "input per expert-tp rank", self.moe_ffn_hidden_size // etp))
        for layer, what, size in dims:
            if size % GEMM_MULTIPLE:
                raise ValueError(
                    f"--fp8-format: {layer}'s {what} is {size}, not divisible by {GEMM_MULTIPLE} "
                    f"(torch._scaled_mm's FP8 GEMM needs every dimension divisible by {GEMM_MULTIPLE})"
                )

    def _validate_tensor_parallel(self) -> None:
        tp = self.tensor_model_parallel_size
        checks = (
            ("--num-attention-heads", self.num_attention_heads),
            ("--num-query-groups", self.num_query_groups),
            ("--ffn-hidden-size", self.ffn_hidden_size),
        )
        if self.sequence_parallel and self.seq_length % tp:
            raise ValueError(
                f"--seq-length ({self.seq_length}) must be divisible by --tensor-model-parallel-size "
                f"({tp}) with --sequence-parallel (each tp rank holds an equal sequence shard)"
            )
        for flag, value in checks:
            if value % tp:
                hint = ""
                if flag == "--num-query-groups":
                    hint = " (each tp rank holds whole key/value groups; use a tp size that divides the groups)"
                raise ValueError(f"{flag} ({value}) is not divisible by --tensor-model-parallel-size ({tp}){hint}")

    def _validate_context_parallel(self) -> None:
        cp, tp = self.context_parallel_size, self.tensor_model_parallel_size
        if cp == 1:
            return
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got {self.cp_comm_type!r}")
        multiple = 2 * cp * (tp if self.sequence_parallel else 1)
        if self.seq_length % multiple:
            detail = (
                f" x --tensor-model-parallel-size ({tp}) under --sequence-parallel" if self.sequence_parallel else ""
            )
            raise ValueError(
                f"--seq-length ({self.seq_length}) must be divisible by 2 x --context-parallel-size "
                f"({cp}){detail} = {multiple}: each cp rank holds two equal chunks"
            )
        if self.attention_dropout > 0:
            raise ValueError(
                f"--attention-dropout {self.attention_dropout} is not supported with "
                f"--context-parallel-size {cp} (the ring attention has no dropout); use 0"
            )

    def kernel_paths(
        self,
        device_type: str,
        *,
        attention_dropout: float | None = None,
        context_parallel: bool | None = None,
        document_mask: bool = False,
        norm_width: int | None = None,
        assume_triton: bool = False,
    ) -> KernelPaths:
        """Which path each op of this model takes on `device_type` (kernels/dispatch.py `kernel_paths`).
        None: the config's own attention dropout, context parallelism (cp > 1) and normalized width
        (hidden_size)."""
        return kernel_paths(
            device_type,
            attention_impl=self.attention_backend,
            norm_impl=self.normalization_impl,
            kernel_impl=self.kernel_impl,
            rope_impl=self.rope_impl,
            swiglu_impl=self.swiglu_impl,
            rotary_dim=self.rotary_dim,
            head_dim=self.kv_channels,
            hidden_size=self.hidden_size if norm_width is None else norm_width,
            dtype=self.params_dtype,
            attention_dropout=self.attention_dropout if attention_dropout is None else attention_dropout,
            context_parallel=self.context_parallel_size > 1 if context_parallel is None else context_parallel,
            document_mask=document_mask,
            assume_triton=assume_triton,
            cross_entropy_impl=self.cross_entropy_impl if self.cross_entropy_loss_fusion else None,
            seq_length=self.seq_length,
            fp8=self.fp8 is not None,
        )

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary padded to a multiple of make_vocab_size_divisible_by x tp, as Megatron does."""
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, self.tensor_model_parallel_size)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` (0-based) holds experts instead of a dense MLP."""
        return self.num_moe_experts is not None and moe_layer_pattern(self.moe_layer_freq, self.num_layers)[layer]

    @property
    def rotary_dim(self) -> int:
        """Channels per head that rotate: int(kv_channels x rotary_percent), as Megatron rounds."""
        return int(self.kv_channels * self.rotary_percent)

    @property
    def output_layer_init_std(self) -> float:
        """Projections into the residual stream are scaled by 1/sqrt(2 L) (GPT-2, Megatron)."""
        return self.init_method_std / math.sqrt(2.0 * self.num_layers)
