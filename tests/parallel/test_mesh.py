"""The mesh orders ranks (pp, dp, cp, tp) with tp fastest, and its groups hold the right ranks."""
from __future__ import annotations

import torch.distributed as dist

from megatron.core.parallel_state import ParallelDims, ParallelMesh
from tests.distributed import run_distributed


def group_ranks(rank, dims=ParallelDims(tp=2, cp=1, dp=2, pp=2)):
    mesh = ParallelMesh(dims, "cpu")
    ranks = {name: dist.get_process_group_ranks(getattr(mesh, f"{name}_group"))
             for name in ("tp", "cp", "dp", "pp", "dp_cp")}
    if mesh.embedding_group is not None:
        ranks["embedding"] = dist.get_process_group_ranks(mesh.embedding_group)
    ranks["coords"] = (mesh.tp_rank, mesh.cp_rank, mesh.dp_rank, mesh.pp_rank)
    return ranks


def test_groups_follow_tp_fastest_order():
    results = run_distributed(8, group_ranks)
    for rank, got in enumerate(results):
        tp, dp, pp = rank % 2, (rank // 2) % 2, rank // 4
        assert got["coords"] == (tp, 0, dp, pp)
        assert got["tp"] == [rank - tp, rank - tp + 1]
        assert got["dp"] == got["dp_cp"] == sorted([rank, rank ^ 2])
        assert got["cp"] == [rank]
        assert got["pp"] == got["embedding"] == sorted([rank, rank ^ 4])


def test_dp_cp_group_spans_data_and_context_ranks():
    results = run_distributed(8, group_ranks, ParallelDims(tp=2, cp=2, dp=2, pp=1))
    for rank, got in enumerate(results):
        tp = rank % 2
        assert got["coords"] == (tp, (rank // 2) % 2, rank // 4, 0)
        assert got["cp"] == sorted([rank, rank ^ 2]) and got["dp"] == sorted([rank, rank ^ 4])
        assert got["dp_cp"] == [r for r in range(8) if r % 2 == tp]


def test_dims_from_world_and_coordinates():
    dims = ParallelDims.from_world(16, tp=2, cp=2, pp=2)
    assert dims.dp == 2
    for rank in range(16):
        assert dims.rank_of(**dims.coords(rank)) == rank
