"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Activations are [s, b, h]. Under sequence parallelism the activations entering a
column-parallel layer are sequence shards (all-gathered here) and a row-parallel
layer's output is reduce-scattered back to sequence shards.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel.mappings import (
    all_gather_sequence,
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_sequence,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.sharding import InitSpec, ShardSpec, make_param


def _group_size_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by {denominator}")
    return numerator // denominator


class _SequenceGatheredLinear(torch.autograd.Function):
    """y = all_gather_seq(x) W^T + b, saving only the sequence shard x (not the gathered
    input): backward gathers x again for the weight gradient, as Megatron does, so sequence
    parallelism keeps 1/tp of each column-parallel layer's input. Backward also
    reduce-scatters the input gradient back to sequence shards."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_sequence(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        gathered = all_gather_sequence(x, ctx.group)
        grad_weight = grad_out.flatten(0, -2).t().mm(gathered.flatten(0, -2))
        del gathered
        grad_bias = grad_out.flatten(0, -2).sum(0) if ctx.has_bias else None
        grad_input = reduce_scatter_sequence(grad_out.matmul(weight), ctx.group)
        return grad_input, grad_weight, grad_bias, None


class ColumnParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split by output rows across tp ranks: Y is split on its last dim.

    `stacked` > 1 splits each of that many stacked output blocks separately
    (SwiGLU's [gate; up]) so every rank holds matching gate and up rows.
    `skip_weight` leaves the weight to be passed to forward (a tied output layer);
    `valid_rows`/`weight_seed_name` shape an output layer's init (see InitSpec).
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group, bias: bool, init_std: float,
                 sequence_parallel: bool = False, gather_output: bool = False, stacked: int = 1,
                 dtype=torch.float32, device=None, skip_weight: bool = False, valid_rows: int | None = None,
                 weight_seed_name: str | None = None):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        self.gather_output = gather_output
        tp, rank = _group_size_rank(tp_group)
        local_out = divide(output_size, tp, "output size of a column-parallel layer over tensor parallel size")
        shard = ShardSpec(dim=0, num_shards=tp, rank=rank, stacked=stacked)
        self.weight = None
        if not skip_weight:
            self.weight = make_param(
                (local_out, input_size),
                InitSpec((output_size, input_size), std=init_std, shard=shard, valid_rows=valid_rows,
                         seed_name=weight_seed_name),
                dtype, device, tensor_model_parallel=True)
        self.bias = None
        if bias:
            self.bias = make_param((local_out,), InitSpec((output_size,), kind="zeros", shard=shard), dtype,
                                   device, tensor_model_parallel=True)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        if self.sequence_parallel:
            y = _SequenceGatheredLinear.apply(x, weight, self.bias, self.tp_group)
        else:
            y = F.linear(copy_to_tensor_parallel_region(x, self.tp_group), weight, self.bias)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.tp_group)
        return y


class RowParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split by input columns: X arrives split on its last dim,
    partial products are summed (all-reduce, or reduce-scatter under sequence
    parallelism) and the bias is added after the reduction."""

    def __init__(self, input_size: int, output_size: int, *, tp_group, bias: bool, init_std: float,
                 sequence_parallel: bool = False, dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        tp, rank = _group_size_rank(tp_group)
        local_in = divide(input_size, tp, "input size of a row-parallel layer over tensor parallel size")
        self.weight = make_param(
            (output_size, local_in),
            InitSpec((output_size, input_size), std=init_std, shard=ShardSpec(dim=1, num_shards=tp, rank=rank)),
            dtype, device, tensor_model_parallel=True)
        self.bias = None
        if bias:
            self.bias = make_param((output_size,), InitSpec((output_size,), kind="zeros"), dtype, device,
                                   sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp_group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split by vocabulary rows. Returns this rank's partial sum
    (zeros for tokens outside its rows); the caller reduces across tp."""

    def __init__(self, padded_vocab_size: int, hidden_size: int, *, tp_group, init_std: float,
                 vocab_size: int, dtype=torch.float32, device=None):
        super().__init__()
        tp, rank = _group_size_rank(tp_group)
        self.rows_per_rank = divide(padded_vocab_size, tp, "padded vocabulary size over tensor parallel size")
        self.vocab_start = rank * self.rows_per_rank
        self.tp_size = tp
        self.weight = make_param(
            (self.rows_per_rank, hidden_size),
            InitSpec((padded_vocab_size, hidden_size), std=init_std, valid_rows=vocab_size,
                     shard=ShardSpec(dim=0, num_shards=tp, rank=rank)),
            dtype, device, tensor_model_parallel=True)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)
