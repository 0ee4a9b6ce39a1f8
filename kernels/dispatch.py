"""The one decision of which path each op of a model takes: `kernel_paths`.

The layers run it, the start-up log prints it, the memory estimate traces it (for a device
elsewhere, as if Triton were installed: `assume_triton`). Each op's path is resolved by
kernels/triton_support.py `op_path` against the kernel's own rule of what it supports.
"""

from dataclasses import dataclass

from kernels.attention_rule import measured_sdpa_backend
from kernels.cross_entropy import unsupported_reason as cross_entropy_unsupported
from kernels.flash_attention import unsupported_reason as attention_unsupported
from kernels.normalization import unsupported_reason as norm_unsupported
from kernels.triton_support import OpPath, op_path

ATTENTION_PATHS = ("ring", "flash_attention", "sdpa", "unfused")
UNFUSED = "unfused"  # the attention impl that selects megatron-core's unfused DotProductAttention


@dataclass(frozen=True)
class KernelPaths:
    """Which path each op of a model takes. `attention`: 'ring' (context parallelism, whose blocks
    run `attention_kernel`), 'flash_attention' (our kernel or its torch reference, by
    `attention_kernel`), 'sdpa' (torch's scaled_dot_product_attention: attention dropout or a
    document mask, which the kernel does not have), or 'unfused' (megatron-core's local-spec
    attention, rounding as it does: --attention-backend unfused|local). `norm`: the normalization
    kernels' path. `cross_entropy`: the fused LM head + cross-entropy's reductions
    (--cross-entropy-loss-fusion; None: the output layer and the cross-entropy run unfused)."""

    attention: str
    attention_kernel: OpPath
    norm: OpPath
    sdpa_reason: str = ""
    cross_entropy: OpPath | None = None
    sdpa_backend: str | None = None  # the SDPA backend pinned (kernels/attention_rule.py), None: torch's choice

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


def kernel_paths(
    device_type,
    *,
    attention_impl,
    norm_impl,
    head_dim,
    hidden_size,
    dtype,
    attention_dropout=0.0,
    context_parallel=False,
    document_mask=False,
    assume_triton=False,
    cross_entropy_impl=None,
    seq_length=None,
) -> KernelPaths:
    """The one decision of which path each op takes on `device_type`, for the layers, the start-up
    log and the memory estimate. `attention_impl` / `norm_impl`: --attention-backend ('unfused', or
    a kernel impl) and --normalization-impl; `hidden_size`: the normalized width; `attention_dropout`: the
    probability in effect (0 in eval); `context_parallel`: a cp group of size > 1;
    `document_mask`: --reset-attention-mask; `assume_triton`: as if Triton were installed (on
    CPU: the interpreter on), for an estimate of a run elsewhere; `cross_entropy_impl`: the fused LM
    head + cross-entropy's impl (None: unfused); `seq_length`: for auto's measured rule
    (kernels/attention_rule.py), which may pin an SDPA backend measured faster than our kernel."""
    unfused = attention_impl == UNFUSED
    attention_kernel = op_path(
        "torch" if unfused else attention_impl,
        device_type,
        attention_unsupported(head_dim, dtype, device_type),
        assume_triton,
    )
    norm = op_path(norm_impl, device_type, norm_unsupported(hidden_size, dtype), assume_triton)
    ce = None
    if cross_entropy_impl is not None:
        ce = op_path(cross_entropy_impl, device_type, cross_entropy_unsupported(dtype), assume_triton)
    if context_parallel:
        return KernelPaths("ring", attention_kernel, norm, cross_entropy=ce)
    if unfused:
        return KernelPaths(UNFUSED, attention_kernel, norm, cross_entropy=ce)
    if document_mask:
        return KernelPaths("sdpa", attention_kernel, norm, "with a document mask (--reset-attention-mask)", ce)
    if attention_dropout > 0.0:
        return KernelPaths("sdpa", attention_kernel, norm, "(attention dropout > 0)", ce)
    backend = measured_sdpa_backend(device_type, head_dim, dtype, seq_length) if attention_impl == "auto" else None
    if backend is not None:
        reason = f"({backend} backend: measured fastest, kernels/attention_rule.py)"
        return KernelPaths("sdpa", attention_kernel, norm, reason, ce, backend)
    return KernelPaths("flash_attention", attention_kernel, norm, cross_entropy=ce)
