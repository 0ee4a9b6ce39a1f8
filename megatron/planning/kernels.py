"""Which kernel runs each memory-relevant op on the device the estimate is for.

Our layers' paths are kernels/dispatch.py `kernel_paths` (assuming Triton is installed: on CPU,
the interpreter on); what is added here is the kernel torch's SDPA picks inside. It is
reported with every estimate (`--json` "kernels"), and it tells the trace (trace.py) which
SDPA kernel a CUDA run would pick (cuda_ops.py); what each kernel saves comes from tracing it.

attention (megatron/core/transformer/attention.py `core_attention`)
  * "ring": context parallelism (cp > 1, whatever the backend; ring_attention.py);
  * "triton": our flash-attention kernel (no dropout; CUDA fp16/bf16 with the head dims it
    takes, or the CPU interpreter with --attention-backend triton);
  * "flash": torch SDPA's flash kernel (the torch reference without dropout on CPU; CUDA
    fp16/bf16 otherwise); "efficient": CUDA memory-efficient SDPA (fp32 without GQA);
  * "math": composite SDPA (CPU with dropout; CUDA otherwise), in fp32 on CPU;
  * "unfused": megatron-core's unfused attention (--attention-backend unfused|local), plain torch ops.
normalisation: "triton" (our kernels) or "torch" (the reference: F.layer_norm, or F.rms_norm,
  composite on CPU and `_fused_rms_norm` on CUDA).
cross entropy: "unfused" (the output layer's logits, then the vocab-parallel cross-entropy), or the
  fused LM head + cross-entropy (--cross-entropy-loss-fusion) with its reductions in "triton" or "torch".
rope, swiglu: "triton" (kernels/rope.py, kernels/swiglu.py: saving only the angles, only the SwiGLU
  input) or "torch" (cos and sin per layer; silu(gate) besides the input); "none" where the model has
  no rotary embedding or no SwiGLU.
dropout: CPU multiplies by a noise tensor of the input dtype; CUDA's fused dropout keeps a bool mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ATTENTION_IMPLS = ("auto", "ring", "triton", "flash", "efficient", "math")


@dataclass(frozen=True)
class KernelChoice:
    attention: str  # "ring" | "triton" | "flash" | "efficient" | "math" | "unfused"
    norm: str  # "triton" | "torch"
    cross_entropy: str = "unfused"  # "unfused" | "triton" | "torch" (the fused pass's reductions)
    rope: str = "none"  # "triton" | "torch" | "none"
    swiglu: str = "none"

    def describe(self) -> str:
        fused = "".join(
            f", {op} {path}" for op, path in (("rope", self.rope), ("swiglu", self.swiglu)) if path != "none"
        )
        fused += "" if self.cross_entropy == "unfused" else f", fused cross entropy {self.cross_entropy}"
        return f"attention {self.attention}, norms {self.norm}{fused}"


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _sdpa_kernel(config, device_type: str, dropout: bool) -> str:
    """The kernel torch's SDPA picks inside (the dispatch's "sdpa" path, or the flash-attention
    kernel's torch reference)."""
    dtype, d = config.params_dtype, config.kv_channels
    if device_type == "cpu":
        return "math" if dropout else "flash"
    if dtype in (torch.float16, torch.bfloat16):
        return "flash" if d <= 256 and d % 8 == 0 else "math"
    return "math" if config.num_query_groups != config.num_attention_heads else "efficient"


def resolve_kernels(config, device_type: str, attention: str = "auto") -> KernelChoice:
    """The kernels our code runs for `config` on `device_type` during training (with Triton installed)."""
    if attention not in ATTENTION_IMPLS:
        raise ValueError(f"attention implementation must be one of {', '.join(ATTENTION_IMPLS)}, got {attention!r}")
    paths = config.kernel_paths(device_type, assume_triton=True)
    if attention != "auto":
        chosen = attention
    elif paths.attention in ("ring", "unfused"):
        chosen = paths.attention
    elif paths.attention == "flash_attention" and paths.attention_kernel.runs_triton:
        chosen = "triton"
    else:
        chosen = _sdpa_kernel(config, device_type, paths.attention == "sdpa")
    ce = paths.cross_entropy
    side = lambda path, used: ("triton" if path.runs_triton else "torch") if used else "none"  # noqa: E731
    return KernelChoice(
        attention=chosen,
        norm=side(paths.norm, True),
        rope=side(paths.rope, config.position_embedding_type == "rope"),
        swiglu=side(paths.swiglu, config.swiglu),
        cross_entropy="unfused" if ce is None else "triton" if ce.runs_triton else "torch",
    )
