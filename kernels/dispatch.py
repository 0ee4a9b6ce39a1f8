"""The one decision of which path each op of a model takes: `kernel_paths`.

The layers run it, the start-up log prints it, the memory estimate traces it (for a device
elsewhere, as if Triton were installed: `assume_triton`). Each op's path is resolved by
kernels/triton_support.py `op_path` against the kernel's own rule of what it supports.

Rule: an op's own switch wins when it names a side ('triton' or 'torch': --attention-backend,
--normalization-impl; --no-rope-fusion and --no-bias-swiglu-fusion give 'torch'); an op left at
'auto' follows --kernel-impl: 'auto' (Triton where it can run: CUDA, or the interpreter when forced),
'torch' (every torch reference), 'triton' (every Triton kernel whose shape and dtype it supports;
an environment that cannot run Triton at all is an error).
"""

from dataclasses import dataclass

from kernels.attention_rule import measured_sdpa_backend
from kernels.cross_entropy import unsupported_reason as cross_entropy_unsupported
from kernels.flash_attention import unsupported_reason as attention_unsupported
from kernels.fp8_cast import unsupported_reason as fp8_cast_unsupported
from kernels.normalization import unsupported_reason as norm_unsupported
from kernels.rope import unsupported_reason as rope_unsupported
from kernels.swiglu import unsupported_reason as swiglu_unsupported
from kernels.triton_support import OpPath, op_path

ATTENTION_PATHS = ("ring", "flash_attention", "sdpa", "unfused")
UNFUSED = "unfused"  # the attention impl that selects megatron-core's unfused DotProductAttention


@dataclass(frozen=True)
class KernelPaths:
    """Which path each op of a model takes. `attention`: 'ring' (context parallelism, whose blocks
    run `attention_kernel`), 'flash_attention' (our kernel or its torch reference, by
    `attention_kernel`), 'sdpa' (torch's scaled_dot_product_attention: attention dropout or a
    document mask, which the kernel does not have), or 'unfused' (megatron-core's local-spec
    attention, rounding as it does: --attention-backend unfused|local). The other fields are one
    op's path each (kernels/<op>.py): the norms, RoPE of q and k, SwiGLU; `cross_entropy`: the fused
    LM head + cross-entropy's reductions (--cross-entropy-loss-fusion; None: the output layer and the
    cross-entropy run unfused); `sdpa_backend`: the SDPA backend pinned (kernels/attention_rule.py),
    None: torch's choice; `fp8_cast`: the FP8 linear layers' per-tensor casts (kernels/fp8_cast.py;
    None: no FP8)."""

    attention: str
    attention_kernel: OpPath
    norm: OpPath
    rope: OpPath
    swiglu: OpPath
    sdpa_reason: str = ""
    cross_entropy: OpPath | None = None
    sdpa_backend: str | None = None
    fp8_cast: OpPath | None = None

    @property
    def attention_line(self) -> str:
        """The start-up log's attention path (the kernel's path, or why SDPA runs instead)."""
        if self.attention == "sdpa":
            return f"torch scaled_dot_product_attention {self.sdpa_reason}"
        if self.attention == UNFUSED:
            return "torch, unfused as megatron-core's DotProductAttention (scores and probabilities stored)"
        return self.attention_kernel.line

    @property
    def cross_entropy_line(self) -> str:
        """The start-up log's LM head + cross-entropy path."""
        return "unfused" if self.cross_entropy is None else f"fused, {self.cross_entropy.line}"


def resolve_op(own_impl, kernel_impl, device_type, unsupported=None, assume_triton=False) -> OpPath:
    """One op's path by the module's rule: `own_impl` its own switch, `kernel_impl` --kernel-impl."""
    if own_impl != "auto" or kernel_impl != "triton":
        impl = own_impl if own_impl != "auto" else kernel_impl
        return op_path(impl, device_type, unsupported, assume_triton)
    if unsupported is not None:  # --kernel-impl triton forces a kernel only where it takes the shape
        return OpPath("torch", f"torch ({unsupported})")
    return op_path("triton", device_type, None, assume_triton)


def kernel_paths(
    device_type,
    *,
    attention_impl,
    norm_impl,
    head_dim,
    hidden_size,
    dtype,
    kernel_impl="auto",
    rope_impl="auto",
    swiglu_impl="auto",
    rotary_dim=None,
    attention_dropout=0.0,
    context_parallel=False,
    document_mask=False,
    assume_triton=False,
    cross_entropy_impl=None,
    seq_length=None,
    fp8=False,
) -> KernelPaths:
    """The one decision of which path each op takes on `device_type`, for the layers, the start-up
    log and the memory estimate. `attention_impl` / `norm_impl` / `rope_impl` / `swiglu_impl`: each
    op's own switch (--attention-backend, 'unfused' or a kernel impl; --normalization-impl;
    'torch' under --no-rope-fusion / --no-bias-swiglu-fusion), `kernel_impl`: --kernel-impl;
    `hidden_size`: the normalized width; `rotary_dim`: the rotating channels per head (None:
    head_dim); `attention_dropout`: the probability in effect (0 in eval); `context_parallel`: a cp
    group of size > 1; `document_mask`: --reset-attention-mask; `assume_triton`: as if Triton were
    installed (on CPU: the interpreter on), for an estimate of a run elsewhere; `cross_entropy_impl`:
    the fused LM head + cross-entropy's own switch (None: unfused); `seq_length`: for auto's measured
    rule (kernels/attention_rule.py), which may pin an SDPA backend measured faster than our kernel;
    `fp8`: the model runs FP8 linear layers (--fp8-format), whose casts follow --kernel-impl."""
    unfused = attention_impl == UNFUSED

    def resolve(own, unsupported):
        return resolve_op(own, kernel_impl, device_type, unsupported, assume_triton)

    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    ops = dict(
        attention_kernel=resolve(
            "torch" if unfused else attention_impl, attention_unsupported(head_dim, dtype, device_type)
        ),
        norm=resolve(norm_impl, norm_unsupported(hidden_size, dtype)),
        rope=resolve(rope_impl, rope_unsupported(head_dim, rotary_dim, dtype)),
        swiglu=resolve(swiglu_impl, swiglu_unsupported(dtype)),
    )
    if cross_entropy_impl is not None:
        ops["cross_entropy"] = resolve(cross_entropy_impl, cross_entropy_unsupported(dtype))
    if fp8:
        ops["fp8_cast"] = resolve("auto", fp8_cast_unsupported(dtype))
    if context_parallel:
        return KernelPaths("ring", **ops)
    if unfused:
        return KernelPaths(UNFUSED, **ops)
    if document_mask:
        return KernelPaths("sdpa", **ops, sdpa_reason="with a document mask (--reset-attention-mask)")
    if attention_dropout > 0.0:
        return KernelPaths("sdpa", **ops, sdpa_reason="(attention dropout > 0)")
    auto = attention_impl == "auto" and kernel_impl == "auto"
    backend = measured_sdpa_backend(device_type, head_dim, dtype, seq_length) if auto else None
    if backend is not None:
        reason = f"({backend} backend: measured fastest, kernels/attention_rule.py)"
        return KernelPaths("sdpa", **ops, sdpa_reason=reason, sdpa_backend=backend)
    return KernelPaths("flash_attention", **ops)
