"""One linear layer for all local experts: rows grouped by expert times one [experts, out, in] weight.

`grouped_linear` runs torch's grouped GEMM (`torch.nn.functional.grouped_mm`: on SM90 with bf16 a CUTLASS kernel that
reads the offsets on the device; on CPU and other GPUs torch's own per-group path) inside an autograd function of
ours, so that each of its limits is handled here, not left to the kernel:

- offsets: int32 cumulative end rows, one per expert, on the device (made here from counts, never read back);
- output dtype = input dtype: activations, their gradient and the weight gradient come out in the weight's dtype,
  as the expert loop's `F.linear` gives them; the gradient buffers then accumulate the weight gradient into the
  fp32 `main_grad` exactly as they do the loop's;
- dtypes and strides: on CUDA the grouped GEMM takes bf16 only, on CPU also float32 and float16 (a shape-only
  call on fake tensors, as the memory estimate traces, allocates the outputs and launches nothing); every row of
  both operands must be a multiple of 16 bytes (`fallback_reason` names the dimension; the model then runs
  `looped_linear` over the same weights, with a start-up note);
- rows past the last offset: the kernel leaves them uninitialised; `mask_tail=True` sets them (and their input
  gradient) to zero, for callers whose row buffer is larger than the routed rows;
- experts with no rows: their weight gradient is set to zero explicitly (the kernel need not write it): with the
  rows per expert known on the host (`empty`), only those experts' slices; else one in-place pass over the weight
  gradient on the device (no host sync);
- no bias: the grouped call takes none (MoE layers refuse --add-bias-linear, see validation.py).

`looped_linear` is the reference: one `F.linear` per expert on the same [experts, out, in] weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

ALIGNMENT_BYTES = 16
GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}


def offsets_of(counts, device) -> torch.Tensor:
    """int32 cumulative end rows [experts] of the rows per expert `counts` (a host list or a device tensor)."""
    if isinstance(counts, torch.Tensor):
        return counts.to(device=device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    ends, total = [], 0
    for n in counts:
        total += n
        ends.append(total)
    host = torch.tensor(ends, dtype=torch.int32)
    if torch.device(device).type == "cuda":  # a copy from pinned memory does not block the host
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def fallback_reason(dtype: torch.dtype, dims: dict[str, int], device_type: str = "cuda") -> str | None:
    """Why torch's grouped GEMM on `device_type` ('cpu', or 'cuda' for any other device and for fake tensors)
    cannot take weights of `dtype` whose row lengths are `dims` (flag name -> size); None when it can."""
    dtypes = GROUPED_DTYPES["cpu" if device_type == "cpu" else "cuda"]
    if dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        return f"{str(dtype).removeprefix('torch.')} on {device_type} (its grouped GEMM takes {names})"
    size = torch.empty((), dtype=dtype).element_size()
    for name, n in dims.items():
        if n * size % ALIGNMENT_BYTES:
            return (
                f"{name} {n} x {size} bytes is not a multiple of {ALIGNMENT_BYTES} bytes (the grouped GEMM's strides)"
            )
    return None


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, shape: tuple) -> torch.Tensor:
    """torch's grouped GEMM; on fake tensors only the output of `shape` (torch's shape check wants bf16 there)."""
    if is_fake(a):
        return a.new_empty(shape)
    return F.grouped_mm(a, b, offs=offsets)


def _valid_rows(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[rows, 1] bool: the row lies before the last offset (no host sync)."""
    return (torch.arange(x.shape[0], device=x.device) < offsets[-1]).unsqueeze(1)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, offsets, mask_tail, empty):
        ctx.save_for_backward(x, weight, offsets)
        ctx.mask_tail, ctx.empty = mask_tail, empty
        out = _grouped_mm(x, weight.transpose(-2, -1), offsets, (x.shape[0], weight.shape[1]))
        return out.masked_fill_(~_valid_rows(x, offsets), 0) if mask_tail else out

    @staticmethod
    def backward(ctx, grad):
        x, weight, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.mask_tail:  # the kernel reads the rows of its groups only, but be exact about what they hold
            grad = torch.where(_valid_rows(x, offsets), grad, 0)
        if ctx.needs_input_grad[0]:
            grad_x = _grouped_mm(grad, weight, offsets, tuple(x.shape))
            if ctx.mask_tail:
                grad_x.masked_fill_(~_valid_rows(x, offsets), 0)
        if ctx.needs_input_grad[1]:
            grad_w = _grouped_mm(grad.transpose(0, 1), x, offsets, tuple(weight.shape))
            if ctx.empty is None:  # rows per expert on the device: every expert's slice, masked in place
                counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
                grad_w.masked_fill_((counts == 0).view(-1, 1, 1), 0)
            for e in ctx.empty or ():
                grad_w[e].zero_()
        return grad_x, grad_w, None, None, None


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, mask_tail: bool = False, counts=None
) -> torch.Tensor:
    """x [rows, in] grouped by expert (expert i's rows end at offsets[i]) times weight [experts, out, in]^T ->
    [rows, out] in x's dtype, through torch's grouped GEMM; rows past offsets[-1] zero when `mask_tail`, else
    undefined. `counts`: the rows per expert as a host list, when known (the experts without rows are then
    zeroed alone in the weight gradient)."""
    if offsets.dtype != torch.int32 or offsets.shape != (weight.shape[0],):
        raise ValueError(f"offsets: int32 of shape ({weight.shape[0]},), got {offsets.dtype} {tuple(offsets.shape)}")
    empty = None if counts is None else [e for e, n in enumerate(counts) if n == 0]
    return _GroupedLinear.apply(x, weight, offsets, mask_tail, empty)


def looped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """What `grouped_linear(..., mask_tail=True)` computes, one `F.linear` per expert (host counts)."""
    pieces = [F.linear(rows, w) for rows, w in zip(x[: sum(counts)].split(counts), weight.unbind(0))]
    tail = x.new_zeros((x.shape[0] - sum(counts), weight.shape[1]))
    return torch.cat(pieces + [tail], dim=0)
