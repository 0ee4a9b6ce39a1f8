"""The FP8 matrix product: `torch._scaled_mm` where the device has FP8 tensor cores, else the same
product emulated from the same FP8 values and scales.

Every product here is in "NT" form, out = a @ bt^T, with both operands [rows, contraction] row-major
(the layout `_scaled_mm` wants once bt is viewed as its column-major transpose):
forward  Y  = X  W^T : a = X [tokens, in],    bt = W   [out, in]
dgrad    dX = dY W   : a = dY [tokens, out],  bt = W^T [in, out]   (the FP8 weight's transpose)
wgrad    dW = dY^T X : a = dY^T [out, tokens], bt = X^T [in, tokens]
"""

from __future__ import annotations

import functools

import torch

from megatron.core.fp8.recipe import BLOCK
from megatron.core.fp8.scaling import dequantize

FP8_CAPABILITY = (8, 9)  # Ada and Hopper and later have FP8 tensor cores


@functools.cache
def device_has_fp8(device: torch.device) -> bool:
    """Whether `device` multiplies FP8 in hardware (CUDA with compute capability >= 8.9); asked once per device."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def refuse_device_without_fp8(device: torch.device) -> None:
    """An FP8 recipe on a CUDA device without FP8: one line. CPU runs the emulation (the tests' path)."""
    if device.type == "cuda" and not device_has_fp8(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"--fp8-format needs a GPU with FP8 tensor cores (compute capability >= 8.9, Ada or Hopper); "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}: drop the --fp8-* flags and train in --bf16"
        )


@functools.cache
def device_has_block_scaled_mm(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` takes 1x128 / 128x128 block scales on `device`: cuBLAS's block scaling,
    compute capability 9.0 (Hopper) with CUDA >= 12.9 (torch 2.9 and later; as torch's own tests gate it)."""
    cuda = tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
    return device_has_fp8(device) and torch.cuda.get_device_capability(device) == (9, 0) and cuda >= (12, 9)


def expand_blocks(scale_inv: torch.Tensor, block_rows: int, shape) -> torch.Tensor:
    """A block scale grid [row blocks, column blocks of 128] as one scale per element of `shape`."""
    rows = scale_inv.repeat_interleave(block_rows, 0)[: shape[0]]
    return rows.repeat_interleave(BLOCK, 1)[:, : shape[1]]


def block_mm(a, a_scale_inv, bt, bt_scale_inv, bt_block_rows: int, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ bt^T from block-quantised operands (kernels/fp8_blocks.py): a [M, K] in 1x128 blocks, bt [N, K]
    in `bt_block_rows` x 128 blocks, each with its scale_inv grid. On a device with block-scaled
    `_scaled_mm` (and every dimension a multiple of 128) cuBLAS multiplies; its output is bf16 only, so an
    fp32 product (wgrad) is the bf16 one widened. Elsewhere `emulated_mm` of the same values and scales."""
    (m, k), n = a.shape, bt.shape[0]
    if device_has_block_scaled_mm(a.device) and not (m % BLOCK or n % BLOCK or k % BLOCK):
        scale_a = a_scale_inv.t().contiguous().t()  # 1x128 scales outer-dimension-major, as cuBLAS wants
        scale_b = bt_scale_inv.t() if bt_block_rows == BLOCK else bt_scale_inv.t().contiguous()
        out = torch._scaled_mm(a, bt.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
        return out.to(out_dtype)
    a_inv = expand_blocks(a_scale_inv, 1, a.shape)
    return emulated_mm(a, a_inv, bt, expand_blocks(bt_scale_inv, bt_block_rows, bt.shape), out_dtype)


def emulated_mm(a, a_scale_inv, bt, bt_scale_inv, out_dtype: torch.dtype) -> torch.Tensor:
    """The product of the dequantised operands in fp32, rounded once to `out_dtype`. Scales broadcast
    against their operand (a scalar per tensor, or one per element for block scaling)."""
    return (dequantize(a, a_scale_inv) @ dequantize(bt, bt_scale_inv).t()).to(out_dtype)


def fp8_mm(a, a_scale_inv, bt, bt_scale_inv, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ bt^T from FP8 operands with per-tensor (0-d) or per-element scale_inv.

    `torch._scaled_mm` on a device with FP8 when both scales are per tensor, a and bt row-major as the
    casts write them (kernels/fp8_cast.py: no copy here); block scales and every other device take
    `emulated_mm` (the block-scaled `_scaled_mm` of the device's torch is not used: not checked on a GPU yet)."""
    per_tensor = a_scale_inv.dim() == 0 and bt_scale_inv.dim() == 0
    if per_tensor and device_has_fp8(a.device):
        return torch._scaled_mm(a, bt.t(), scale_a=a_scale_inv, scale_b=bt_scale_inv, out_dtype=out_dtype)
    return emulated_mm(a, a_scale_inv, bt, bt_scale_inv, out_dtype)


def startup_line(recipe, device: torch.device) -> str:
    """The start-up log's FP8 line: the recipe and which path multiplies."""
    blockwise = recipe.recipe == "blockwise"
    hardware = device_has_block_scaled_mm(device) if blockwise else device_has_fp8(device)
    path = "emulated (the FP8 values multiplied in fp32)"
    if hardware:
        path = "torch._scaled_mm" + (
            " with 1x128/128x128 block scales (blocks whole on this rank)" if blockwise else ""
        )
    layers = ""
    if recipe.first_last_layers_bf16:
        layers = (
            f", first {recipe.num_layers_at_start_in_bf16} / last {recipe.num_layers_at_end_in_bf16} layers in BF16"
        )
    return (
        f"> fp8: {recipe.recipe} scaling, format {recipe.format}, wgrad {'FP8' if recipe.wgrad else 'high precision'}"
        f"{layers}; linear layers' GEMMs: {path}"
    )
