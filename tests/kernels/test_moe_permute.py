"""Expert permutation kernels (kernels/moe_permute.py) under the Triton interpreter, against their torch references
and float64: the permute gathers each route's token, the unpermute sums each token's rows (top-k of them, padding
rows and tokens without rows included), both in the forward and as each other's backward; the result does not depend
on the run (the same bits twice) and equals the scatter-add it replaces within rounding."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_permute import gather_rows_torch, launch_config, permute_rows, sum_slots_torch, unpermute_rows
from megatron.core.transformer.moe.token_dispatcher import permute, unpermute
from tests.kernels.checks import TOL, assert_close

TOKENS, EXPERTS, TOPK, HIDDEN = 24, 6, 3, 40


def _routing(seed: int):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(TOKENS, EXPERTS, generator=g)
    chosen = scores.topk(TOPK, dim=1).indices
    routing_map = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, chosen, True)
    routing_map[3] = False  # a token routed nowhere (dropped by capacity, or routed to another rank's experts)
    probs = torch.where(routing_map, scores, 0)
    return routing_map, probs, torch.randn(TOKENS, HIDDEN, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding", [0, 5])
def test_permute_and_unpermute_kernels_match_the_reference_and_float64(dtype, padding, seed):
    routing_map, probs, tokens = _routing(seed % 1000)
    routes = int(routing_map.sum())
    tokens = tokens.to(dtype)
    _, row_probs, perm = permute(tokens, routing_map, probs, routes + padding, TOPK)
    assert (perm.token_of_row[routes:] == -1).all() and (row_probs[routes:] == 0).all()
    results = {}
    for impl in ("triton", "torch"):
        x = tokens.clone().requires_grad_()
        rows = permute_rows(x, perm.token_of_row, perm.slots, impl)
        out = unpermute_rows(rows * 1.5, perm.token_of_row, perm.slots, impl)
        grad = torch.linspace(-1, 1, out.numel()).view_as(out).to(dtype)
        out.backward(grad)
        results[impl] = (rows.detach(), out.detach(), x.grad)
    assert torch.count_nonzero(results["triton"][0][routes:]) == 0  # padding rows are zero
    x64 = tokens.double()
    token_of_row = perm.token_of_row[:routes]
    rows64 = x64[token_of_row]
    out64 = torch.zeros_like(x64).index_add(0, token_of_row, rows64 * 1.5)  # the scatter-add it replaces
    grad64 = torch.zeros_like(x64).index_add(0, token_of_row, 1.5 * grad.double()[token_of_row])
    for impl, (rows, out, grad_x) in results.items():
        assert_close(f"{impl} rows", rows[:routes], rows64, TOL[dtype], seed)
        assert_close(f"{impl} out", out, out64, TOL[dtype], seed)
        assert_close(f"{impl} grad", grad_x, grad64, TOL[dtype], seed)
        assert torch.count_nonzero(out[3]) == 0  # the token routed nowhere
    if dtype == torch.float32:  # the same order of additions (the interpreter rounds bf16 its own way)
        assert all(torch.equal(a, b) for a, b in zip(results["triton"], results["torch"]))


def test_unpermute_sums_in_a_fixed_order_run_after_run(seed):
    routing_map, probs, tokens = _routing(seed % 1000)
    _, _, perm = permute(tokens, routing_map, probs, int(routing_map.sum()), TOPK)
    rows = torch.randn(perm.token_of_row.shape[0], HIDDEN)
    first = unpermute(rows, perm)
    assert all(torch.equal(first, unpermute(rows, perm)) for _ in range(3))


def test_slots_list_each_tokens_rows_and_padding_routes_widen_them():
    routing_map, probs, tokens = _routing(0)
    _, _, perm = permute(tokens, routing_map, probs, int(routing_map.sum()), TOPK)
    assert perm.slots.shape == (TOKENS, TOPK)
    for t in range(TOKENS):
        rows = sorted(int(r) for r in perm.slots[t] if r >= 0)
        assert rows == [r for r in range(perm.token_of_row.shape[0]) if perm.token_of_row[r] == t]
    padded_map = routing_map.clone()
    padded_map[:, 0] = True  # capacity padding: weight-0 routes beyond a token's top-k
    _, _, perm = permute(tokens, padded_map, probs, int(padded_map.sum()), EXPERTS)
    assert perm.slots.shape == (TOKENS, EXPERTS) and int((perm.slots >= 0).sum()) == int(padded_map.sum())


def test_references_skip_negative_indices():
    x = torch.arange(6.0).view(3, 2)
    assert gather_rows_torch(x, torch.tensor([2, -1, 0])).tolist() == [[4.0, 5.0], [0.0, 0.0], [0.0, 1.0]]
    assert sum_slots_torch(x, torch.tensor([[0, 2], [-1, -1]])).tolist() == [[4.0, 6.0], [0.0, 0.0]]


@pytest.mark.parametrize(
    "tokens_n, hidden, experts, topk, padding",
    [(1, 8, 2, 1, 0), (7, 24, 3, 2, 3), (33, 72, 16, 6, 0), (5, 4104, 4, 3, 1), (9, 40, 10, 10, 2)],
)
def test_odd_shapes_match_the_reference_exactly(tokens_n, hidden, experts, topk, padding):
    """Odd token counts, hidden sizes that are not a power of two or wider than one tile (4104 > TILE_ELEMENTS:
    two column steps), one expert per token, every expert per token (slots = experts, more than one unrolled
    group of loads), padding rows: int32 indices, the Triton kernels equal to the torch reference bit for bit
    (float32: the same order of additions) in forward and backward."""
    g = torch.Generator().manual_seed(tokens_n * 1000 + hidden)
    scores = torch.rand(tokens_n, experts, generator=g)
    routing_map = torch.zeros(tokens_n, experts, dtype=torch.bool).scatter(1, scores.topk(topk, dim=1).indices, True)
    x = torch.randn(tokens_n, hidden, generator=g)
    routes = int(routing_map.sum())
    _, row_probs, perm = permute(x, routing_map, torch.where(routing_map, scores, 0), routes + padding, topk)
    assert perm.token_of_row.dtype == perm.slots.dtype == torch.int32
    assert torch.equal(row_probs[:routes], scores.T[routing_map.T])  # each row's weight, expert-major
    grad = torch.randn(tokens_n, hidden, generator=g)
    results = {}
    for impl in ("triton", "torch"):
        tokens = x.clone().requires_grad_()
        rows = permute_rows(tokens, perm.token_of_row, perm.slots, impl)
        out = unpermute_rows(rows * 0.75, perm.token_of_row, perm.slots, impl)
        out.backward(grad)
        results[impl] = (rows.detach(), out.detach(), tokens.grad)
    assert all(torch.equal(a, b) for a, b in zip(results["triton"], results["torch"]))
    assert torch.equal(results["triton"][0][:routes], x[perm.token_of_row[:routes].long()])
    assert torch.count_nonzero(results["triton"][0][routes:]) == 0


def test_launch_config_fills_a_tile_with_whole_rows():
    assert launch_config(16384, 4096) == (1, 4096, 8)  # Mixtral's hidden: one row, 16 values per thread
    assert launch_config(16384, 2048) == (2, 2048, 8)  # two rows per program
    assert launch_config(100, 6144) == (1, 4096, 8)  # wider than a tile: two column steps
    assert launch_config(3, 40) == (4, 64, 1)  # no more rows per program than there are rows
