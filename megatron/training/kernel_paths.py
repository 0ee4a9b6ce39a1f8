"""Which attention and normalization implementation runs, checked before training starts."""

from __future__ import annotations

import torch

from kernels.flash_attention import attention_path
from kernels.normalization import norm_path


def kernel_paths(model, device: torch.device, document_mask: bool = False) -> dict:
    """{'attention': path, 'normalization': path}; raises ValueError naming the flag when a
    forced Triton path cannot run here. `document_mask`: --reset-attention-mask, which runs
    torch's SDPA with an explicit mask (forcing the kernel is refused with the flags)."""
    attention = attention_path(model.attention_backend, device, model.kv_channels, model.params_dtype)
    if model.attention_dropout > 0.0:
        if model.attention_backend == "triton":
            raise ValueError(
                "--attention-backend triton has no attention dropout; use --attention-dropout 0 "
                "or --attention-backend torch"
            )
        attention = "torch scaled_dot_product_attention (attention dropout > 0)"
    if document_mask:
        attention = "torch scaled_dot_product_attention with a document mask (--reset-attention-mask)"
    normalization = norm_path(model.normalization_impl, device, model.hidden_size, model.params_dtype)
    for flag, path in (("--attention-backend", attention), ("--normalization-impl", normalization)):
        if path.startswith("error"):
            raise ValueError(f"{flag} triton cannot run: {path[len('error (') : -1]}")
    return {"attention": attention, "normalization": normalization}
