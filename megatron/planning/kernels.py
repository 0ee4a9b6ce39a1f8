"""Which kernel runs each memory-relevant op on the device the estimate is for.

The choice follows the dispatch of our layers (kernels/dispatch.py `use_triton`, with the
kernels' own `unsupported_reason`), assuming Triton is installed on CUDA machines. It is
reported with every estimate (`--json` "kernels"), and it tells the trace (trace.py) which
SDPA kernel a CUDA run would pick (cuda_ops.py); what each kernel saves comes from tracing it.

attention (megatron/core/transformer/attention.py `core_attention`)
  * "ring": context parallelism (cp > 1, whatever the backend; ring_attention.py);
  * "triton": our flash-attention kernel (no dropout; CUDA fp16/bf16 with the head dims it
    takes, or the CPU interpreter with --attention-backend triton);
  * "flash": torch SDPA's flash kernel (the torch reference without dropout on CPU; CUDA
    fp16/bf16 otherwise); "efficient": CUDA memory-efficient SDPA (fp32 without GQA);
  * "math": composite SDPA (CPU with dropout; CUDA otherwise), in fp32 on CPU.
normalisation: "triton" (our kernels) or "torch" (the reference: F.layer_norm, or F.rms_norm,
  composite on CPU and `_fused_rms_norm` on CUDA).
dropout: CPU multiplies by a noise tensor of the input dtype; CUDA's fused dropout keeps a bool mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.flash_attention import unsupported_reason as attention_unsupported
from kernels.normalization import unsupported_reason as norm_unsupported

ATTENTION_IMPLS = ("auto", "ring", "triton", "flash", "efficient", "math")


@dataclass(frozen=True)
class KernelChoice:
    attention: str  # "ring" | "triton" | "flash" | "efficient" | "math"
    norm: str  # "triton" | "torch"

    def describe(self) -> str:
        return f"attention {self.attention}, norms {self.norm}"


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _triton_runs(impl: str, device_type: str) -> bool:
    """dispatch.use_triton's environment rule: 'auto' on CUDA only; 'triton' also in the CPU interpreter."""
    return impl != "torch" and (device_type == "cuda" or impl == "triton")


def _auto_attention(config, device_type: str) -> str:
    dtype, d = config.params_dtype, config.kv_channels
    if config.context_parallel_size > 1:
        return "ring"
    if (
        config.attention_dropout == 0.0
        and _triton_runs(config.attention_backend, device_type)
        and attention_unsupported(d, dtype, device_type) is None
    ):
        return "triton"
    if device_type == "cpu":
        return "flash" if config.attention_dropout == 0.0 else "math"
    if dtype in (torch.float16, torch.bfloat16):
        return "flash" if d <= 256 and d % 8 == 0 else "math"
    return "math" if config.num_query_groups != config.num_attention_heads else "efficient"


def resolve_kernels(config, device_type: str, attention: str = "auto") -> KernelChoice:
    """The kernels our code runs for `config` on `device_type` during training."""
    if attention not in ATTENTION_IMPLS:
        raise ValueError(f"attention implementation must be one of {', '.join(ATTENTION_IMPLS)}, got {attention!r}")
    triton_norm = (
        _triton_runs(config.normalization_impl, device_type)
        and norm_unsupported(config.hidden_size, config.params_dtype) is None
    )
    return KernelChoice(
        attention=_auto_attention(config, device_type) if attention == "auto" else attention,
        norm="triton" if triton_norm else "torch",
    )
