"""The start-up log's kernel paths (kernels/dispatch.py `kernel_paths` decides them), checked before training starts."""

from __future__ import annotations

import torch

from kernels.moe_permute import permute_path


def startup_kernel_paths(model, device: torch.device, document_mask: bool = False) -> dict:
    """{'attention': path, 'normalization': path, 'lm head + cross entropy': path} (and 'moe permutation'
    with experts); raises ValueError naming the flag when a forced Triton path cannot run here.
    `document_mask`: --reset-attention-mask, which runs torch's SDPA with an explicit mask (forcing the
    kernel is refused with the flags)."""
    if model.attention_dropout > 0.0 and model.attention_backend == "triton":
        raise ValueError(
            "--attention-backend triton has no attention dropout; use --attention-dropout 0 "
            "or --attention-backend torch"
        )
    paths = model.kernel_paths(device.type, context_parallel=False, document_mask=document_mask)
    attention, normalization = paths.attention_line, paths.norm.line
    for flag, path in (("--attention-backend", attention), ("--normalization-impl", normalization)):
        if path.startswith("error"):
            raise ValueError(f"{flag} triton cannot run: {path[len('error (') : -1]}")
    if paths.cross_entropy is not None and paths.cross_entropy.error:
        raise ValueError(f"--cross-entropy-loss-fusion: its Triton kernels cannot run: {paths.cross_entropy.error}")
    lines = {
        "attention": attention,
        "normalization": normalization,
        "lm head + cross entropy": paths.cross_entropy_line,
    }
    if model.num_moe_experts is not None:
        lines["moe permutation"] = permute_path("auto", device)
    return lines
