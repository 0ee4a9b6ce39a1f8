"""Which kernel runs each memory-relevant op, because that decides what autograd keeps.

The choice follows the dispatch of our layers (kernels/dispatch.py `use_triton`, with the
kernels' own `unsupported_reason`), assuming Triton is installed on CUDA machines. What each
path saves was read from the code and, for CPU, verified with
`torch.autograd.graph.saved_tensors_hooks` (torch 2.13); the CUDA paths are NOT validated
on a GPU yet.

attention (megatron/core/transformer/attention.py `core_attention`)
  * "ring": context parallelism (cp > 1, whatever the backend:
    megatron/core/context_parallel/ring_attention.py, p2p or all-gather): saves q, k, v
    as given (views of the rotated q / k and of the QKV output), its output (a new
    [b, s, heads, d] tensor in the input dtype) and the fp32 log-sum-exp [b, heads, s],
    never a received K/V block; the projection input is a copy of the transposed output.
  * "triton": our flash-attention kernel (no dropout; CUDA fp16/bf16, head dims 32/64/128,
    or the CPU interpreter with --attention-backend triton). Its wrapper saves contiguous
    [b, s, heads, d] copies of q, k and v, the output and the fp32 log-sum-exp
    [b, heads, s]; the output projection's input is another copy (reshape of the
    transposed output).
  * "flash": torch SDPA's flash kernel (the torch reference without dropout on CPU; CUDA
    fp16/bf16 otherwise): saves q, k, v as given (views: the QKV output stays alive through
    v), the output ([b, s, heads, d] in memory, so the projection input is a view) and
    the fp32 log-sum-exp.
  * "efficient": CUDA memory-efficient SDPA (fp32 without GQA): as flash, the
    log-sum-exp padded to a multiple of 32 along s.
  * "math": composite SDPA (CPU with dropout; CUDA otherwise): the scaled q and k, the
    softmax probabilities and, with dropout, the dropout mask and the dropped
    probabilities ([b, heads, s, s] each), and v (a view of the QKV output when no
    copy or cast is needed); on CPU it computes in fp32 even for bf16/fp16.
normalisation (megatron/core/transformer/norm.py via kernels/normalization.py)
  * "triton": saves x, rstd and (LayerNorm) mean, both fp32 [rows].
  * "torch" reference: upcasts x and the weight (and bias) to fp32 (copies unless
    already fp32) and calls F.layer_norm (saves x, weight, bias, mean, rstd) or
    F.rms_norm: on CPU the composite (saves x, rstd, the normalised x and the weight,
    all fp32), on CUDA `_fused_rms_norm` (saves x, rstd and the weight).
dropout (`F.dropout`): CPU multiplies by a noise tensor of the input dtype and saves it;
  CUDA's fused dropout saves a bool mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.flash_attention import unsupported_reason as attention_unsupported
from kernels.normalization import unsupported_reason as norm_unsupported

ATTENTION_IMPLS = ("auto", "ring", "triton", "flash", "efficient", "math")


@dataclass(frozen=True)
class KernelChoice:
    attention: str             # "ring" | "triton" | "flash" | "efficient" | "math"
    attention_math_bytes: int  # element size the math path computes in
    norm: str                  # "triton" | "torch"
    torch_rms_norm: str        # what F.rms_norm runs: "composite" (CPU) | "fused" (CUDA)
    dropout_mask_bytes: int    # per element of a hidden-dropout mask

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
    if (config.attention_dropout == 0.0 and _triton_runs(config.attention_backend, device_type)
            and attention_unsupported(d, dtype, device_type) is None):
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
    cpu = device_type == "cpu"
    triton_norm = (_triton_runs(config.normalization_impl, device_type)
                   and norm_unsupported(config.hidden_size, config.params_dtype) is None)
    return KernelChoice(
        attention=_auto_attention(config, device_type) if attention == "auto" else attention,
        attention_math_bytes=4 if cpu else dtype_bytes(config.params_dtype),
        norm="triton" if triton_norm else "torch",
        torch_rms_norm="composite" if cpu else "fused",
        dropout_mask_bytes=dtype_bytes(config.params_dtype) if cpu else 1,
    )
