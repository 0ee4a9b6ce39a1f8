"""Weight gradients of linear layers, computed in backward or queued for later (split backward).

A linear layer whose weight lives in a gradient buffer adds grad_out^T x into the weight's
`main_grad` itself (tensor_parallel/layers.py `_Linear`). While the weight's queue
(`param.weight_grad_queue`, set by the buffers that own it) is `deferring()`, it queues that
work instead: the backward then computes input gradients (and the gradients of every
parameter that is not such a weight), and `queue.compute()` adds the weight gradients later.
A pipeline stage thus sends its input gradient upstream before spending the other half of its
backward -- the B/W split of zero-bubble pipelining (Qi et al., 2023). The queue holds each
linear layer's output gradient until then.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.core.tensor_parallel.mappings import all_gather_sequence


def sequence_input(x: torch.Tensor, sp_group) -> torch.Tensor:
    """A layer's whole input: x, all-gathered over the sequence under sequence parallelism."""
    return x if sp_group is None else all_gather_sequence(x, sp_group)


@dataclass
class WeightGrad:
    """One linear layer's weight gradient, grad_out^T x, to add into the weight's main_grad
    (with one addmm when `fuse`: gradient accumulation fusion; for bf16/fp16 weights the product
    is accumulated in main_grad's fp32, `accumulate_in_main_grad_dtype`)."""

    param: torch.Tensor
    grad_out: torch.Tensor  # [tokens, out features]
    x: torch.Tensor  # the layer's input (a sequence shard under sequence parallelism)
    sp_group: object
    fuse: bool
    product: Callable | None = None  # (grad_out, input) -> fp32 weight gradient (an FP8 GEMM); None: grad_out^T x

    def accumulate(self) -> None:
        total_input = sequence_input(self.x, self.sp_group).flatten(0, -2)
        main_grad, grad_out = self.param.main_grad, self.grad_out.t()
        if self.product is not None:
            main_grad.add_(self.product(self.grad_out, total_input))  # an FP8 GEMM's fp32 product
        elif not self.fuse:
            main_grad.add_(grad_out.mm(total_input))  # the product rounded to the weight's dtype, then added
        elif main_grad.dtype == grad_out.dtype:
            main_grad.addmm_(grad_out, total_input)
        else:
            accumulate_in_main_grad_dtype(main_grad, grad_out, total_input)


def accumulate_in_main_grad_dtype(main_grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """main_grad (fp32) += a @ b of bf16/fp16 operands, the products summed in fp32 and never rounded to
    the operands' dtype. CUDA: one GEMM that reads and writes main_grad (addmm with an fp32 out_dtype;
    measured on an H200, torch 2.11, [4096 x 8192] @ [8192 x 4096]: 0.355 ms against 0.401 ms for
    the bf16 product and an add, error 1e-5 against 2e-3 relative). CPU has no such GEMM: the
    operands are upcast (the same sum, slower)."""
    if main_grad.device.type == "cuda":
        torch.addmm(main_grad, a, b, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.addmm_(a.to(main_grad.dtype), b.to(main_grad.dtype))


class WeightGradQueue:
    """Where a model chunk's gradients of a backward go once added into `main_grad`: final now
    (`on_final`, the buffers' readiness accounting), or, in a split backward, queued with the weight
    gradients that backward left for later, per microbatch.

    Zero-bubble schedules run a microbatch's WEIGHT step after later microbatches' backwards, so
    the queue keeps each microbatch's work apart. While deferring it also notes the parameters
    whose gradients that backward completed (`added`): their gradients count as final only
    at the microbatch's WEIGHT step, so a bucket's reduction sees whole microbatches."""

    def __init__(self, on_final: Callable[[torch.Tensor], None]):
        self.on_final = on_final
        self.pending: dict[int, list[WeightGrad]] = {}
        self.finished: dict[int, list] = {}  # microbatch -> parameters its backward completed
        self.params: dict[int, set] = {}  # microbatch -> parameters with a weight gradient queued
        self.microbatch: int | None = None  # inside deferring(): the microbatch being backpropagated

    @property
    def active(self) -> bool:
        return self.microbatch is not None

    @contextlib.contextmanager
    def deferring(self, microbatch: int = 0):
        """A backward of `microbatch` inside queues the weight gradients of this queue's parameters."""
        self.microbatch = microbatch
        try:
            yield
        finally:
            self.microbatch = None

    def take(self, weight_grad: WeightGrad, deferrable: bool) -> None:
        """A linear layer's weight gradient in backward: queued while deferring (when `deferrable`),
        else added into main_grad now. The layer then calls `added`."""
        if self.active and deferrable:
            self.pending.setdefault(self.microbatch, []).append(weight_grad)
            self.params.setdefault(self.microbatch, set()).add(weight_grad.param)
        else:
            weight_grad.accumulate()

    def added(self, param) -> None:
        """`param`'s gradient of the backward in progress is in its main_grad: final now, or while
        deferring at the microbatch's WEIGHT step (unless queued: its weight gradient is still to come)."""
        if not self.active:
            self.on_final(param)
        elif param not in self.params.get(self.microbatch, ()):
            self.finished.setdefault(self.microbatch, []).append(param)

    def compute(self, microbatch: int = 0, prepare=None) -> list[torch.Tensor]:
        """Add `microbatch`'s queued gradients into their main_grad (`prepare(param)` first, if
        given); return the parameters whose gradient of that microbatch is now complete."""
        work = self.pending.pop(microbatch, [])
        self.params.pop(microbatch, None)
        with torch.no_grad():
            for weight_grad in work:
                if prepare is not None:
                    prepare(weight_grad.param)
                weight_grad.accumulate()
        return list(dict.fromkeys(self.finished.pop(microbatch, []) + [w.param for w in work]))
