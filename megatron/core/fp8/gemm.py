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
    hardware = device_has_fp8(device) and recipe.recipe != "blockwise"
    path = "torch._scaled_mm" if hardware else "emulated (the FP8 values multiplied in fp32)"
    layers = ""
    if recipe.first_last_layers_bf16:
        layers = (
            f", first {recipe.num_layers_at_start_in_bf16} / last {recipe.num_layers_at_end_in_bf16} layers in BF16"
        )
    return (
        f"> fp8: {recipe.recipe} scaling, format {recipe.format}, wgrad {'FP8' if recipe.wgrad else 'high precision'}"
        f"{layers}; linear layers' GEMMs: {path}"
    )
