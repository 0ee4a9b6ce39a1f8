"""Block scaling under tensor parallelism: blocks lie on the full tensor's grid, so a block that tp cuts (a
stacked gate/up weight split, a row-parallel input narrower than 128 per rank) gets one process's scale
through the tp group. Values are chosen so that the pieces' own amaxes fall in other binades than the
whole block's (a power-of-two scale hides small differences)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.fp8.linear import Fp8Gemms
from megatron.core.fp8.recipe import INPUT, Fp8Recipe
from megatron.core.tensor_parallel.initialization import InitSpec, ShardSpec
from tests.distributed import run_distributed

RECIPE = Fp8Recipe(format="e4m3", recipe="blockwise")


def _tensors():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 96, generator=generator)
    weight[192:] *= 8.0  # the up half's second rows (rank 1's under the stacked split) in another binade
    x = torch.randn(24, 96, generator=generator)
    x[:, 48:] *= 8.0  # rank 1's input columns of a row-parallel layer
    return weight, x


def _owner(shape, shard):
    owner = torch.nn.Module()
    local = list(shape)
    local[shard.dim] //= shard.num_shards
    owner.weight = torch.nn.Parameter(torch.zeros(local))
    owner.weight.init_spec = InitSpec(tuple(shape), shard=shard)
    return owner


def _quantised(rank: int) -> dict:
    weight, x = _tensors()
    one = Fp8Gemms(RECIPE, _owner((256, 96), ShardSpec(0, 1, 0)), weight_group=None, activation_groups=(), expert=False)
    column_shard = ShardSpec(0, 2, rank, stacked=2)  # fc1's [gate; up] rows
    column = Fp8Gemms(
        RECIPE, _owner((256, 96), column_shard), weight_group=dist.group.WORLD, activation_groups=(), expert=False
    )
    row_shard = ShardSpec(1, 2, rank)  # fc2's input columns
    row = Fp8Gemms(
        RECIPE, _owner((256, 96), row_shard), weight_group=dist.group.WORLD, activation_groups=(), expert=False
    )
    full_w = one._weight_blocks(weight)
    full_x = one._rows(x, INPUT, torch.arange(96), 96, None)
    cols = torch.arange(48 * rank, 48 * rank + 48)
    return {
        "weight": [t.float() for t in column._weight_blocks(column_shard.shard(weight))],
        "weight_expected": [column_shard.shard(t.float()) for t in full_w],
        "input": [t.float() for t in row._rows(x[:, cols], INPUT, cols, 96, row._in_group)],
        "input_expected": [t[:, cols].float() for t in full_x],
    }


def test_blocks_cut_by_tensor_parallelism_get_one_process_scales():
    for rank, out in enumerate(run_distributed(2, _quantised)):
        for key in ("weight", "input"):
            for got, expected in zip(out[key], out[f"{key}_expected"]):
                assert torch.equal(got, expected), f"rank {rank} {key}"
