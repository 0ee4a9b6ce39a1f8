"""The start-up log's kernel paths (kernels/dispatch.py `kernel_paths` decides them), checked before training starts."""

from __future__ import annotations

import torch

from kernels.moe_permute import permute_path


def _forcing_flag(own_flag: str | None, own_impl: str) -> str:
    """The flag that forced an op onto Triton: its own switch when it names triton, else --kernel-impl."""
    return own_flag if own_flag is not None and own_impl == "triton" else "--kernel-impl"


def startup_kernel_paths(model, device: torch.device, document_mask: bool = False) -> dict:
    """{op: path} for the ops this model runs (attention, normalization, rope, swiglu, the LM head +
    cross entropy, the MoE permutation); raises ValueError naming the flag when a forced Triton path
    cannot run here. `document_mask`: --reset-attention-mask, which runs torch's SDPA with an explicit
    mask (forcing the kernel is refused with the flags)."""
    if model.attention_dropout > 0.0 and model.attention_backend == "triton":
        raise ValueError(
            "--attention-backend triton has no attention dropout; use --attention-dropout 0 "
            "or --attention-backend torch"
        )
    paths = model.kernel_paths(device.type, context_parallel=False, document_mask=document_mask)
    ops = {  # op: (its path, its own switch, the switch's value)
        "attention": (paths.attention_line, "--attention-backend", model.attention_backend),
        "normalization": (paths.norm.line, "--normalization-impl", model.normalization_impl),
    }
    if model.position_embedding_type == "rope":
        ops["rope"] = (paths.rope.line, None, model.rope_impl)
    if model.swiglu:
        ops["swiglu"] = (paths.swiglu.line, None, model.swiglu_impl)
    if paths.fp8_cast is not None:
        ops["fp8 casts"] = (paths.fp8_cast.line, None, "auto")
    for path, flag, impl in ops.values():
        if path.startswith("error"):
            raise ValueError(f"{_forcing_flag(flag, impl)} triton cannot run: {path[len('error (') : -1]}")
    if paths.cross_entropy is not None and paths.cross_entropy.error:
        raise ValueError(f"--cross-entropy-loss-fusion: its Triton kernels cannot run: {paths.cross_entropy.error}")
    lines = {op: path for op, (path, _, _) in ops.items()}
    lines["lm head + cross entropy"] = paths.cross_entropy_line
    if model.num_moe_experts is not None:
        lines["MoE permutation"] = permute_path("auto", device)
    return lines
