"""Context-parallel attention on 2 and 4 gloo ranks against one-process causal attention in
float64: output and dq, dk, dv of every rank's load-balanced chunks, both comm types, MHA and
GQA, torch reference and Triton kernels (interpreter); with bf16 inputs, dK/dV equal the fp32 sum
of every block's share rounded once. Plus, without processes: the sharding,
the chunk-pair mask rule, load balance, the block-level backward, and saved-tensor memory.

Each world size starts its ranks once (a module fixture) and every check reads its results.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kernels import flash_attention as fa
from megatron.core.context_parallel import (
    COMM_STATS,
    context_parallel_attention,
    positions,
    ring_attention,
    shard,
    unshard,
)
from megatron.core.context_parallel.ring_attention import visible_pairs
from megatron.core.context_parallel.sharding import causal_pairs, chunk_ids
from tests.distributed import run_distributed

SEQ, HEAD_DIM, TOL = 32, 64, 1e-6
# (comm type, impl, batch, heads, kv heads); Triton runs in the interpreter, so smaller
CASES = [
    (comm, impl, batch, heads, kv_heads)
    for comm in ("p2p", "all_gather")
    for impl, batch, heads in (("torch", 2, 4), ("triton", 1, 2))
    for kv_heads in (heads, heads // 2)
]


def _problem(batch, heads, kv_heads, seq=SEQ):
    """Full-sequence q, k, v and the output gradient, float64; every rank builds the same."""
    g = torch.Generator().manual_seed(1000 * heads + 10 * kv_heads + batch)
    q = torch.randn(batch, seq, heads, HEAD_DIM, generator=g, dtype=torch.float64)
    k, v = (torch.randn(batch, seq, kv_heads, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(q.shape, generator=g, dtype=torch.float64)


def _one_rank(q, k, v, dout):
    """Output and dq, dk, dv of causal attention over the whole sequence in one process."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fa.flash_attention_block_torch(*leaves, True)[0]
    return (out.detach(), *torch.autograd.grad((out * dout).sum(), leaves))


def _relative_error(actual, expected):
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


def _cp_run(q, k, v, dout, group, comm, impl, cp_rank, cp_size):
    """This rank's output and dq, dk, dv (fp32), and the bytes it saved for backward."""
    local = [shard(t, cp_rank, cp_size).float().requires_grad_() for t in (q, k, v)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
    ):
        out = context_parallel_attention(*local, group, comm_type=comm, impl=impl)
    grads = torch.autograd.grad((out * shard(dout, cp_rank, cp_size).float()).sum(), local)
    return (out.detach(), *grads), sum(saved)


def _rank_checks(rank, cp):
    """Errors against the one-rank reference, bytes sent and bytes saved, per case."""
    results = {}
    for comm, impl, batch, heads, kv_heads in CASES:
        q, k, v, dout = _problem(batch, heads, kv_heads)
        with COMM_STATS.counting() as stats:
            actual, saved = _cp_run(q, k, v, dout, dist.group.WORLD, comm, impl, rank, cp)
        errors = {
            name: _relative_error(a, shard(e, rank, cp))
            for name, a, e in zip(("out", "dq", "dk", "dv"), actual, _one_rank(q, k, v, dout))
        }
        results[comm, impl, batch, heads, kv_heads] = dict(errors=errors, sent=dict(stats.bytes), saved=saved)
    return results, _bf16_block_gradients(rank, cp)


def _bf16_block_gradients(rank, cp):
    """With bf16 inputs, per comm type: this rank's dk and dv, and every block's share of them
    that this rank's backward computed (fp64, by global key chunk)."""
    q, k, v, dout = (t.bfloat16() for t in _problem(1, 2, 1))
    length = SEQ // (2 * cp)
    key_chunks = k.split(length, dim=1)
    real, parts = ring_attention.flash_attention_block_backward, []

    def recording(q_, k_, *rest, **kwargs):
        dq_, dk_, dv_ = real(q_, k_, *rest, **kwargs)
        chunk = next(c for c, key in enumerate(key_chunks) if torch.equal(key, k_))
        parts.append((chunk, dk_.double(), dv_.double()))
        return dq_, dk_, dv_

    out = {}
    ring_attention.flash_attention_block_backward = recording
    try:
        for comm in ("p2p", "all_gather"):
            parts.clear()
            local = [shard(t, rank, cp).requires_grad_() for t in (q, k, v)]
            attention = context_parallel_attention(*local, dist.group.WORLD, comm_type=comm, impl="torch")
            _, dk, dv = torch.autograd.grad((attention * shard(dout, rank, cp)).sum(), local)
            out[comm] = dict(dk=dk.double(), dv=dv.double(), parts=list(parts))
    finally:
        ring_attention.flash_attention_block_backward = real
    return out


@pytest.fixture(scope="module")
def cp_worlds():
    """cp size -> per-rank (results per case, bf16 block gradients), each world started once."""
    cache = {}

    def results(cp):
        if cp not in cache:
            cache[cp] = run_distributed(cp, _rank_checks, cp)
        return cache[cp]

    return results


@pytest.fixture(scope="module")
def cp_results(cp_worlds):
    return lambda cp: [checks for checks, _ in cp_worlds(cp)]


@pytest.mark.parametrize("cp", [2, 4])
def test_bf16_dk_dv_are_summed_in_fp32(cp_worlds, cp):
    """bf16 dK/dV: every block's share (from every rank) summed in fp32 and rounded to bf16
    once, so each element is within half a bf16 ulp of the exact sum of the shares; summing
    in bf16 rounds at every chunk and hop and lands further away."""
    ranks = [bf16 for _, bf16 in cp_worlds(cp)]
    for comm in ("p2p", "all_gather"):
        exact, magnitude = {}, {}
        for rank in ranks:
            for chunk, dk, dv in rank[comm]["parts"]:
                part = torch.stack([dk, dv])
                exact[chunk] = exact.get(chunk, 0) + part
                magnitude[chunk] = magnitude.get(chunk, 0) + part.abs()
        for r, rank in enumerate(ranks):
            ids = chunk_ids(r, cp)
            want = torch.cat([exact[c] for c in ids], dim=2)
            slack = torch.cat([magnitude[c] for c in ids], dim=2) * 2.0**-22  # fp32 rounding of the sums
            half_ulp = torch.ldexp(torch.ones_like(want), torch.frexp(want).exponent - 9)
            error = (torch.stack([rank[comm]["dk"], rank[comm]["dv"]]) - want).abs()
            worst = (error / (half_ulp + slack)).max().item()
            assert worst <= 1.0, f"cp {cp} {comm} rank {r}: dk/dv {worst:.2f} x (half a bf16 ulp) from the exact sum"


@pytest.mark.parametrize("cp", [2, 4])
def test_output_and_gradients_match_one_rank(cp_results, cp):
    for rank, by_case in enumerate(cp_results(cp)):
        for case, result in by_case.items():
            for name, err in result["errors"].items():
                assert err <= TOL, f"cp {cp} rank {rank} {case}: {name} relative error {err:.1e}"


@pytest.mark.parametrize("cp", [2, 4])
def test_bytes_sent_match_the_analytic_volume(cp_results, cp):
    """p2p: each rank sends its K/V block c-1 hops forward; backward again, plus c-1 dK/dV
    accumulators (fp32, as K/V here). all_gather counts the gathered K/V (forward and the
    re-gather in backward) and the reduce-scattered dK/dV of all blocks."""
    for case, result in cp_results(cp)[0].items():
        comm, _, batch, _, kv_heads = case
        block = 2 * batch * (SEQ // cp) * kv_heads * HEAD_DIM * 4  # this rank's K and V, fp32
        expected = (
            {"p2p": 3 * (cp - 1) * block}
            if comm == "p2p"
            else {"all_gather": 2 * cp * block, "reduce_scatter": cp * block}
        )
        assert result["sent"] == expected, case


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_saved_bytes_fall_as_one_over_cp(cp_results, comm):
    """At fixed total sequence length each rank saves 1/c of what one rank saves: its own
    q, k, v, output and lse, never a received block."""
    case = next(c for c in CASES if c[:2] == (comm, "torch"))
    q, k, v, dout = _problem(*case[2:])
    one_rank = _cp_run(q, k, v, dout, None, comm, "torch", 0, 1)[1]
    for cp in (2, 4):
        per_rank = [by_case[case]["saved"] for by_case in cp_results(cp)]
        assert per_rank == [one_rank // cp] * cp, (cp, per_rank, one_rank)


def test_shard_round_trip_and_positions():
    x = torch.arange(2 * 48 * 3).view(2, 48, 3)
    for cp in (1, 2, 3, 4):
        shards = [shard(x, r, cp) for r in range(cp)]
        assert torch.equal(unshard(shards), x)
        assert torch.equal(unshard([shard(x[0], r, cp, dim=0) for r in range(cp)], dim=0), x[0])
        for r, part in enumerate(shards):
            assert torch.equal(part[0, :, 0] // 3, positions(48, r, cp))
    assert positions(8, 1, 2).tolist() == [2, 3, 4, 5]


def test_shard_refuses_indivisible_length():
    with pytest.raises(ValueError, match=r"^sequence length 30 must be divisible by 2 x context-parallel size 4 = 8"):
        shard(torch.zeros(1, 30), 0, 4)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_chunk_pairs_are_exactly_the_causal_mask(cp):
    """The pairs each ring step computes (full / causal / skipped) cover the causal mask of the
    global positions exactly."""
    seq = 8 * cp
    chunk = seq // (2 * cp)
    for q_rank in range(cp):
        q_pos = positions(seq, q_rank, cp)
        for kv_rank in range(cp):
            k_pos = positions(seq, kv_rank, cp)
            computed = torch.zeros(2 * chunk, 2 * chunk, dtype=torch.bool)
            for qi, ki, causal in visible_pairs(q_rank, kv_rank, cp):
                block = torch.ones(chunk, chunk, dtype=torch.bool)
                computed[qi * chunk : (qi + 1) * chunk, ki * chunk : (ki + 1) * chunk] = (
                    block.tril() if causal else block
                )
            assert torch.equal(computed, k_pos[None, :] <= q_pos[:, None]), (q_rank, kv_rank)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_load_balanced_split_gives_every_rank_the_same_work(cp):
    seq = 64
    work = [causal_pairs(positions(seq, r, cp)) for r in range(cp)]
    assert work == [seq * (seq + 1) // 2 // cp] * cp
    contiguous = [causal_pairs(torch.arange(seq).chunk(cp)[r]) for r in range(cp)]
    assert max(contiguous) > 2 * min(contiguous)
    assert chunk_ids(0, cp) == (0, 2 * cp - 1)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_block_backward_from_global_statistics(impl, causal):
    """Gradients of one key block, computed from the output and lse over two blocks, equal that
    block's part of the autograd gradients of the merged attention (float64 reference)."""
    q, k, v, dout = _problem(2, 4, 2, seq=16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    first = fa.flash_attention_block_torch(leaves[0], leaves[1][:, :8], leaves[2][:, :8], False)
    second = fa.flash_attention_block_torch(leaves[0][:, 8:], leaves[1][:, 8:], leaves[2][:, 8:], causal)
    out, lse = fa.merge_attention_blocks(first[0][:, 8:], first[1][..., 8:], *second)
    dq, dk, dv = torch.autograd.grad((out * dout[:, 8:]).sum(), leaves)
    block = fa.flash_attention_block_backward(
        *(t.float() for t in (q[:, 8:], k[:, 8:], v[:, 8:], out, lse, dout[:, 8:])), causal, impl=impl
    )
    # the second block's own share: the first block's keys add their share of dq separately
    first_share = fa.flash_attention_block_backward_torch(
        q[:, 8:], k[:, :8], v[:, :8], out.detach(), lse.detach(), dout[:, 8:], False
    )[0]
    for name, actual, expected in zip(("dq", "dk", "dv"), block, (dq[:, 8:] - first_share, dk[:, 8:], dv[:, 8:])):
        assert _relative_error(actual, expected) <= TOL, name


def test_refuses_bad_arguments_before_communicating():
    q = torch.zeros(1, 4, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="comm_type must be one of"):
        context_parallel_attention(q, q, q, None, comm_type="ring")
    with pytest.raises(ValueError, match="s_local even"):
        context_parallel_attention(q[:, :3], q[:, :3], q[:, :3], None)
    with pytest.raises(ValueError, match="h a multiple of h_kv"):
        context_parallel_attention(torch.zeros(1, 4, 3, HEAD_DIM), q, q, None)
