"""The mesh numbers ranks by its rank order (default tp fastest, then cp, dp, pp; with
--use-tp-pp-dp-mapping tp, cp, pp, dp), and its groups hold the right ranks."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron.core.parallel_state import DEFAULT_ORDER, TP_PP_DP_ORDER, ParallelDims, ParallelMesh
from tests.distributed import run_distributed


def group_ranks(rank, dims=ParallelDims(tp=2, cp=1, dp=2, pp=2)):
    mesh = ParallelMesh(dims, "cpu")
    ranks = {
        name: dist.get_process_group_ranks(getattr(mesh, f"{name}_group")) for name in ("tp", "cp", "dp", "pp", "dp_cp")
    }
    if mesh.embedding_group is not None:
        ranks["embedding"] = dist.get_process_group_ranks(mesh.embedding_group)
    ranks["coords"] = (mesh.tp_rank, mesh.cp_rank, mesh.dp_rank, mesh.pp_rank)
    ranks["pp_peers"] = (mesh.pp_peer(-1), mesh.pp_peer(+1))
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
        assert got["pp_peers"] == (rank ^ 4, rank ^ 4)


def test_dp_cp_group_spans_data_and_context_ranks():
    results = run_distributed(8, group_ranks, ParallelDims(tp=2, cp=2, dp=2, pp=1))
    for rank, got in enumerate(results):
        tp = rank % 2
        assert got["coords"] == (tp, (rank // 2) % 2, rank // 4, 0)
        assert got["cp"] == sorted([rank, rank ^ 2]) and got["dp"] == sorted([rank, rank ^ 4])
        assert got["dp_cp"] == [r for r in range(8) if r % 2 == tp]


def test_tp_pp_dp_order_puts_pipeline_stages_next_to_each_other():
    """--use-tp-pp-dp-mapping on 8 ranks, tp 2 x pp 2 x dp 2: rank = tp + 2 pp + 4 dp (Megatron's
    tp-cp-ep-pp-dp), so a pipeline is ranks {0, 2}, {1, 3}, ... and dp replicas are 4 apart."""
    results = run_distributed(8, group_ranks, ParallelDims(tp=2, cp=1, dp=2, pp=2, order=TP_PP_DP_ORDER))
    for rank, got in enumerate(results):
        tp, pp, dp = rank % 2, (rank // 2) % 2, rank // 4
        assert got["coords"] == (tp, 0, dp, pp)
        assert got["tp"] == [rank - tp, rank - tp + 1]
        assert got["pp"] == got["embedding"] == sorted([rank, rank ^ 2])
        assert got["pp_peers"] == (rank ^ 2, rank ^ 2)
        assert got["dp"] == got["dp_cp"] == sorted([rank, rank ^ 4])
        assert got["cp"] == [rank]


def test_tp_pp_dp_order_with_context_parallel_and_four_stages():
    """cp 2 x pp 4 under the alternative order: cp stays next to tp, the middle stages hold no
    embedding group, and the dp x cp group is the cp group when dp is 1."""
    results = run_distributed(8, group_ranks, ParallelDims(tp=1, cp=2, dp=1, pp=4, order=TP_PP_DP_ORDER))
    for rank, got in enumerate(results):
        cp, pp = rank % 2, rank // 2
        assert got["coords"] == (0, cp, 0, pp)
        assert got["pp"] == [cp, cp + 2, cp + 4, cp + 6]
        assert got.get("embedding") == ([cp, cp + 6] if pp in (0, 3) else None)
        assert got["pp_peers"] == (cp + 2 * ((pp - 1) % 4), cp + 2 * ((pp + 1) % 4))
        assert got["cp"] == got["dp_cp"] == [rank - cp, rank - cp + 1] and got["dp"] == [rank]


@pytest.mark.parametrize("order", [DEFAULT_ORDER, TP_PP_DP_ORDER, ("pp", "dp", "tp", "cp")])
def test_dims_from_world_and_coordinates(order):
    dims = ParallelDims.from_world(48, tp=2, cp=3, pp=4, order=order)
    assert dims.dp == 2
    assert sorted(dims.rank_of(**dims.coords(rank)) for rank in range(48)) == list(range(48))
    for rank in range(48):
        assert dims.rank_of(**dims.coords(rank)) == rank
    fastest, slowest = order[0], order[-1]
    assert dims.coords(1)[fastest] == 1 and dims.coords(dims.world_size - 1)[slowest] == dims.size(slowest) - 1
    assert dims.coords(dims.world_size // dims.size(slowest))[slowest] == 1


def test_tp_pp_dp_order_numbers_like_megatron():
    """Megatron's RankGenerator: global rank = sum of coordinate x prefix product of the order's sizes."""
    dims = ParallelDims(tp=2, cp=3, dp=2, pp=4, order=TP_PP_DP_ORDER)
    for tp, cp, pp, dp in [(1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (1, 2, 3, 1)]:
        assert dims.rank_of(tp=tp, cp=cp, dp=dp, pp=pp) == tp + 2 * cp + 6 * pp + 24 * dp


def test_order_must_name_each_dimension_once():
    with pytest.raises(ValueError, match="rank order must name tp, cp, dp and pp once each, got tp-tp-dp-pp"):
        ParallelDims(order=("tp", "tp", "dp", "pp"))
