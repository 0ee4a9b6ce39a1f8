"""Section `fp8_ops` of part fp8: where an FP8 linear layer's time goes, at the 8B layer's fc1 (tokens = the
part's sequence, 4096 -> 2 x 14336), each op timed alone with CUDA events (median of 5 after a warm-up):

- the GEMM alone: bf16 `F.linear`, FP8 `torch._scaled_mm` with per-tensor scales, and the block-scaled
  product (kernels: `block_mm`: cuBLAS's 1x128/128x128 block scaling where the device has it, else emulated);
- the quantisation alone, on the torch ops (`torch`) and on the fused Triton kernels (`triton`,
  kernels/fp8_cast.py and kernels/fp8_blocks.py): the forward's input and weight per recipe, the backward's
  output gradient (cast and transposed for both backward GEMMs);
- one whole linear layer, forward + backward (three GEMMs and their casts), per recipe and path, beside
  the bf16 layer.

`vs bf16 GEMM`: the op's time over the bf16 GEMM's. A dry run runs every op once at the part's tiny shape
(Triton in the interpreter) and times nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8_blocks import quantize_blocks
from kernels.fp8_cast import quantize, tensor_amax
from megatron.core.fp8.gemm import block_mm, device_has_block_scaled_mm, device_has_fp8
from megatron.core.fp8.linear import Fp8Gemms
from megatron.core.fp8.recipe import BLOCK, Fp8Recipe, fp8_max
from megatron.core.fp8.scaling import current_scale
from megatron.core.fp8.scaling import quantize_blocks as quantize_blocks_per_element
from megatron.core.tensor_parallel.initialization import InitSpec
from megatron.core.tensor_parallel.layers import linear
from tools.gpu_check_lib.moe_check import _time_ms
from tools.gpu_check_lib.report import NA
from tools.gpu_check_lib.runs import error_line

COLUMNS = ["op", "path", "ms", "vs bf16 GEMM", "error"]
PATHS = ("torch", "triton")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _current(x, dtype, impl):
    """Tensorwise: the amax pass, the scale on the device, the cast."""
    scale = current_scale(tensor_amax(x, impl), dtype)
    return quantize(x, scale, dtype, impl)


def _layer(recipe: Fp8Recipe, weight: torch.Tensor, impl: str) -> torch.nn.Module:
    owner = torch.nn.Module()
    owner.weight = torch.nn.Parameter(weight.clone())
    owner.weight.init_spec = InitSpec(tuple(weight.shape))
    owner.fp8 = Fp8Gemms(recipe, owner, weight_group=None, activation_groups=(), expert=False, cast_impl=lambda _: impl)
    if recipe.delayed:  # past calibration: scales of this weight and of unit-scale activations and gradients
        owner.fp8.has_history = True
        amaxes = torch.stack([torch.tensor(4.0), weight.abs().max().float().cpu(), torch.tensor(1e-3)])
        limits = torch.tensor([fp8_max(E4M3), fp8_max(E4M3), fp8_max(E5M2)])
        owner.fp8_scale.copy_(limits / amaxes)
        owner.fp8_scale_inv.copy_(owner.fp8_scale.reciprocal())
    return owner


def _ops(x, w, g):
    """{(op, path): zero-argument function} of every op the section times."""
    ops = {("GEMM y = x W^T", "bf16 F.linear"): lambda: F.linear(x, w)}
    s_x, s_w = (current_scale(t.abs().amax().float(), E4M3) for t in (x, w))
    xq, wq = quantize(x, s_x, E4M3, "torch")[0], quantize(w, s_w, E4M3, "torch")[0]
    if device_has_fp8(x.device):
        inv_x, inv_w = s_x.reciprocal(), s_w.reciprocal()
        ops[("GEMM y = x W^T", "fp8 _scaled_mm, per-tensor scales")] = lambda: torch._scaled_mm(
            xq, wq.t(), scale_a=inv_x, scale_b=inv_w, out_dtype=torch.bfloat16
        )
    xb, _, xb_inv = quantize_blocks(x, 1, E4M3, "torch")
    wb, _, wb_inv = quantize_blocks(w, BLOCK, E4M3, "torch")
    block_path = "cuBLAS block scaling" if device_has_block_scaled_mm(x.device) else "emulated"
    ops[("GEMM y = x W^T", f"fp8 block_mm ({block_path})")] = lambda: block_mm(
        xb, xb_inv, wb, wb_inv, BLOCK, torch.bfloat16
    )
    delayed_scale = torch.tensor(fp8_max(E4M3) / 8.0, device=x.device)
    for impl in PATHS:
        amax = torch.zeros(1, device=x.device)
        ops[("quantise x, W: tensorwise (amax + cast)", impl)] = lambda impl=impl: (
            _current(x, E4M3, impl),
            _current(w, E4M3, impl),
        )
        ops[("quantise x, W: delayed (cast + amax record)", impl)] = lambda impl=impl, amax=amax: (
            quantize(x, delayed_scale, E4M3, impl, amax_out=amax),
            quantize(w, delayed_scale, E4M3, impl, amax_out=amax),
        )
        ops[("quantise grad: tensorwise, e5m2, + transpose", impl)] = lambda impl=impl: quantize(
            g, current_scale(tensor_amax(g, impl), E5M2), E5M2, impl, columnwise=True
        )
        ops[("quantise x 1x128, W 128x128: blockwise", impl)] = lambda impl=impl: (
            quantize_blocks(x, 1, E4M3, impl),
            quantize_blocks(w, BLOCK, E4M3, impl),
        )
    rows, cols = torch.arange(x.shape[0], device=x.device), torch.arange(x.shape[1], device=x.device)
    ops[("quantise x, W: blockwise", "torch, per-element scales (tp-cut blocks)")] = lambda: (
        quantize_blocks_per_element(x, rows, cols, (1, BLOCK), tuple(x.shape), E4M3),
        quantize_blocks_per_element(w, torch.arange(w.shape[0], device=x.device), cols, (BLOCK, BLOCK), w.shape, E4M3),
    )
    return ops


def _linear_ops(x, w, g):
    """{(op, path): forward + backward of one linear layer} in bf16 and each recipe on each cast path."""
    x = x.detach().requires_grad_()
    bf16 = torch.nn.Parameter(w.clone())

    def step(weight, fp8):
        y = linear(x, weight, None, fp8=fp8)
        y.backward(g)

    ops = {("linear fwd + bwd", "bf16"): lambda: step(bf16, None)}
    for name in ("tensorwise", "delayed", "blockwise"):
        recipe = Fp8Recipe(format="e4m3" if name == "blockwise" else "hybrid", recipe=name)
        for impl in PATHS:
            owner = _layer(recipe, w, impl)
            ops[("linear fwd + bwd", f"fp8 {name}, {impl} casts")] = lambda o=owner: step(o.weight, o.fp8)
    return ops


def check_fp8_ops(report, ctx, m: dict) -> None:
    """`m`: the part's shape (hidden, ffn, seq)."""
    section = report.section("fp8_ops", "FP8 linear layer: GEMM vs quantisation, torch vs fused", COLUMNS)
    tokens, k, n = m["seq"], m["hidden"], 2 * m["ffn"]
    generator = torch.Generator(device=ctx.device).manual_seed(0)
    x = torch.randn(tokens, k, device=ctx.device, generator=generator).bfloat16()
    w = (torch.randn(n, k, device=ctx.device, generator=generator) * 0.02).bfloat16()
    g = (torch.randn(tokens, n, device=ctx.device, generator=generator) * 1e-3).bfloat16()
    bf16_ms = None
    for (op, path), fn in {**_ops(x, w, g), **_linear_ops(x, w, g)}.items():
        skipped = ctx.skip(5)
        if skipped:
            section.add(op=op, path=path, ms=skipped, error=skipped)
            continue
        try:
            ms = _time_ms(ctx, fn)
        except (RuntimeError, ValueError) as error:
            section.add(op=op, path=path, error=error_line(error))
            continue
        bf16_ms = ms if path == "bf16 F.linear" else bf16_ms
        ratio = ms / bf16_ms if isinstance(ms, float) and isinstance(bf16_ms, float) else NA if ctx.dry_run else None
        section.add(op=op, path=path, ms=ms, **{"vs bf16 GEMM": ratio})
    section.notes += [
        f"fc1 of the 8B layer: x [{tokens}, {k}], W [{n}, {k}], grad [{tokens}, {n}], bf16; CUDA events, median of 5",
        "torch: the ops of megatron/core/fp8/scaling.py and the kernels' references; triton: kernels/fp8_cast.py "
        "(one pass per cast, transposed copy and amax record in the same pass) and kernels/fp8_blocks.py",
    ]
