"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Activations are [s, b, h]. Under sequence parallelism the activations entering a
column-parallel layer are sequence shards (all-gathered here) and a row-parallel
layer's output is reduce-scattered back to sequence shards.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel.initialization import InitSpec, ShardSpec, make_param
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_sequence,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.weight_grads import WeightGrad, sequence_input


def _group_size_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by {denominator}")
    return numerator // denominator


class _Linear(torch.autograd.Function):
    """y = x W^T + b, x first all-gathered over the sequence when `sp_group` is given.

    Sequence parallelism: only the sequence shard x is saved (not the gathered input);
    backward gathers x again for the weight gradient, as Megatron does, so a
    column-parallel layer keeps 1/tp of its input, and reduce-scatters the input
    gradient back to sequence shards.

    `param` is the layer's own weight when it has a `main_grad` buffer (ModelChunkBuffers):
    backward then adds the weight gradient into `main_grad` itself, with one addmm when
    `fuse` (Megatron's gradient accumulation fusion: no weight-gradient tensor is made and
    added later), or queues it during a split backward, and tells the chunk's queue that the
    gradient is complete (`param.weight_grad_queue`, weight_grads.py). Autograd never sees such a
    weight: `weight` is then a detached alias of it, so backward has no AccumulateGrad node and no
    buffer hook to run for it (megatron-core hands autograd an uninitialised placeholder of the
    weight's size so that its buffer's hook runs, free from CUDA's caching allocator but on CPU an
    allocation, an AccumulateGrad and a Python hook per layer and microbatch: docs/pipeline.md
    "1F1B against torch"). So the weight must be used by this one call per forward: a second use
    would report its gradient complete twice (the buffer refuses that). The parameter itself is
    kept in ctx (saved tensors may come back as plain tensors without `main_grad`, e.g. from
    activation recomputation).
    """

    @staticmethod
    def forward(ctx, x, weight, sp_group, param, fuse, deferrable, fp8):
        ctx.sp_group, ctx.param, ctx.fuse, ctx.deferrable, ctx.fp8 = sp_group, param, fuse, deferrable, fp8
        ctx.save_for_backward(x, weight)
        total = sequence_input(x, sp_group)
        if fp8 is None:
            return F.linear(total, weight)
        y, ctx.fp8_saved = fp8.forward(total.flatten(0, -2), weight)
        return y.view(*total.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_2d = grad_out.flatten(0, -2)
        product = None  # the weight-gradient GEMM: grad^T x in the model's precision, or FP8's
        if ctx.fp8 is not None:
            g_fp8 = ctx.fp8.quantize_grad(grad_2d, dgrad=ctx.needs_input_grad[0])
            product = functools.partial(ctx.fp8.wgrad, saved=ctx.fp8_saved, grad=g_fp8)
        grad_weight, queue = None, None
        if ctx.param is None:
            total_2d = sequence_input(x, ctx.sp_group).flatten(0, -2)
            grad_weight = grad_2d.t().mm(total_2d) if product is None else product(grad_2d, total_2d).to(weight.dtype)
        else:
            weight_grad = WeightGrad(ctx.param, grad_2d, x, ctx.sp_group, ctx.fuse, product)
            queue = getattr(ctx.param, "weight_grad_queue", None)
            if queue is None:  # a main_grad outside gradient buffers (the memory trace's, a test's)
                weight_grad.accumulate()
            else:
                queue.take(weight_grad, ctx.deferrable)
        grad_input = None
        if ctx.needs_input_grad[0]:  # not for a first layer fed with data
            if ctx.fp8 is None:
                grad_input = grad_out.matmul(weight)
            else:
                grad_input = ctx.fp8.dgrad(grad_2d, weight, ctx.fp8_saved, g_fp8).view(*grad_out.shape[:-1], -1)
            if ctx.sp_group is not None:
                grad_input = reduce_scatter_sequence(grad_input, ctx.sp_group)
        if queue is not None:  # only now: a sharded weight may be released once its gradient is complete
            queue.added(ctx.param)
        return grad_input, grad_weight, None, None, None, None, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    sp_group=None,
    owned: bool = True,
    gradient_accumulation_fusion: bool = False,
    deferrable: bool = True,
    fp8=None,
) -> torch.Tensor:
    """x W^T + b: the product through `_Linear` when it does something autograd's linear does not
    (gather over the sequence; gradients of the layer's own weight straight into its main_grad
    buffer), else F.linear. Fused accumulation of bf16/fp16 weights sums the product in main_grad's
    fp32 (weight_grads.py `accumulate_in_main_grad_dtype`). The bias is added to the
    product rounded to its dtype, as megatron-core's linear layers do (a fused addmm rounds once).
    `fp8`: the layer's FP8 GEMMs (megatron/core/fp8/linear.py `Fp8Gemms`), or None."""
    main_grad = getattr(weight, "main_grad", None)
    param = weight if (owned and main_grad is not None and weight.requires_grad and torch.is_grad_enabled()) else None
    if sp_group is None and param is None and fp8 is None:
        y = F.linear(x, weight)
    else:
        fuse = gradient_accumulation_fusion and param is not None
        weight = weight if param is None else weight.detach()  # its gradient goes into main_grad, not through autograd
        y = _Linear.apply(x, weight, sp_group, param, fuse, deferrable, fp8)
    return add_bias(y, bias)


def add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y + bias, the product rounded before the bias is added (megatron-core's order). In place
    when that changes no dtype: y is the fresh output of the product or of a reduction, saved by no
    autograd node, so the sum needs no second activation-sized tensor (on CPU an allocation and a
    free per layer and microbatch; docs/pipeline.md "1F1B against torch"). A view keeps `+`:
    autograd refuses in-place changes to views made inside a custom Function (FP8's output)."""
    if bias is None:
        return y
    if torch.result_type(y, bias) != y.dtype or y._is_view():
        return y + bias
    return y.add_(bias)


class ColumnParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split by output rows across tp ranks: Y is split on its last dim.

    `stacked` > 1 splits each of that many stacked output blocks separately
    (SwiGLU's [gate; up]) so every rank holds matching gate and up rows.
    `skip_weight` leaves the weight to be passed to forward (a tied output layer);
    `real_rows`/`weight_seed_name` shape an output layer's init (see InitSpec).
    `gradient_accumulation_fusion`: see `_Linear` (another module's weight passed to forward, which
    may be used elsewhere too -- the tied embedding -- gets its gradient through autograd).
    `split_backward_defers=False` keeps the weight gradient in the backward even in a split
    backward (the output layer: deferring it would hold the logits' gradient).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group,
        bias: bool,
        init_std: float,
        sequence_parallel: bool = False,
        gather_output: bool = False,
        stacked: int = 1,
        dtype=torch.float32,
        device=None,
        skip_weight: bool = False,
        real_rows: int | None = None,
        weight_seed_name: str | None = None,
        gradient_accumulation_fusion: bool = False,
        split_backward_defers: bool = True,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.gather_output = gather_output
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.split_backward_defers = split_backward_defers
        self.fp8 = None  # the FP8 GEMMs of a transformer layer's linear layer (megatron/core/fp8/model.py)
        tp, rank = _group_size_rank(tp_group)
        local_out = divide(output_size, tp, "output size of a column-parallel layer over tensor parallel size")
        shard = ShardSpec(dim=0, num_shards=tp, rank=rank, stacked=stacked)
        self.weight = None
        if not skip_weight:
            self.weight = make_param(
                (local_out, input_size),
                InitSpec(
                    (output_size, input_size),
                    std=init_std,
                    shard=shard,
                    real_rows=real_rows,
                    seed_name=weight_seed_name,
                ),
                dtype,
                device,
                tensor_model_parallel=True,
            )
        self.bias = None
        if bias:
            self.bias = make_param(
                (local_out,),
                InitSpec((output_size,), kind="zeros", shard=shard),
                dtype,
                device,
                tensor_model_parallel=True,
            )

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None, add_bias: bool = True) -> torch.Tensor:
        """`weight`: another module's (a tied output layer); `add_bias` False: the caller adds
        `self.bias` itself (inside the SwiGLU kernel)."""
        owned = weight is None or weight is self.weight  # the untied output layer is handed its own
        weight = self.weight if owned else weight
        bias = self.bias if add_bias else None
        grad_options = dict(
            owned=owned,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            deferrable=self.split_backward_defers,
            fp8=self.fp8,
        )
        if self.sequence_parallel:
            y = linear(x, weight, bias, sp_group=self.tp_group, **grad_options)
        else:
            y = linear(copy_to_tensor_parallel_region(x, self.tp_group), weight, bias, **grad_options)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.tp_group)
        return y


class RowParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split by input columns: X arrives split on its last dim,
    partial products are summed (all-reduce, or reduce-scatter under sequence
    parallelism) and the bias is added after the reduction."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group,
        bias: bool,
        init_std: float,
        sequence_parallel: bool = False,
        dtype=torch.float32,
        device=None,
        gradient_accumulation_fusion: bool = False,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.fp8 = None  # see ColumnParallelLinear
        tp, rank = _group_size_rank(tp_group)
        local_in = divide(input_size, tp, "input size of a row-parallel layer over tensor parallel size")
        self.weight = make_param(
            (output_size, local_in),
            InitSpec((output_size, input_size), std=init_std, shard=ShardSpec(dim=1, num_shards=tp, rank=rank)),
            dtype,
            device,
            tensor_model_parallel=True,
        )
        self.bias = None
        if bias:
            self.bias = make_param(
                (output_size,),
                InitSpec((output_size,), kind="zeros"),
                dtype,
                device,
                sequence_parallel=sequence_parallel,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, gradient_accumulation_fusion=self.gradient_accumulation_fusion, fp8=self.fp8)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp_group)
        return add_bias(y, self.bias)


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split by vocabulary rows. Returns this rank's partial sum
    (zeros for tokens outside its rows); the caller reduces across tp."""

    def __init__(
        self,
        padded_vocab_size: int,
        hidden_size: int,
        *,
        tp_group,
        init_std: float,
        vocab_size: int,
        dtype=torch.float32,
        device=None,
    ):
        super().__init__()
        tp, rank = _group_size_rank(tp_group)
        self.rows_per_rank = divide(padded_vocab_size, tp, "padded vocabulary size over tensor parallel size")
        self.vocab_start = rank * self.rows_per_rank
        self.tp_size = tp
        self.weight = make_param(
            (self.rows_per_rank, hidden_size),
            InitSpec(
                (padded_vocab_size, hidden_size),
                std=init_std,
                real_rows=vocab_size,
                shard=ShardSpec(dim=0, num_shards=tp, rank=rank),
            ),
            dtype,
            device,
            tensor_model_parallel=True,
        )

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)
