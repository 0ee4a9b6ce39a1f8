"""Causal attention over a sequence split across context-parallel ranks.

Each cp rank holds two load-balanced chunks of the sequence (`sharding`: rank r holds chunks
r and 2c-1-r) of q, k and v. Attention is computed block by block: the local queries against
the K/V block of every cp rank, each block split into its two chunks. A query chunk qc sees a
key chunk kc fully when kc < qc, causally when kc == qc (the diagonal) and not at all when
kc > qc, so masked pairs are skipped. Partial results are merged with their log-sum-exp in
fp32 (`merge_attention_blocks`), which makes the result exact, not approximate.

Two ways to bring the K/V blocks (K/V heads travel, never the repeated query heads of GQA):
  * "p2p": a ring. At step t rank r holds the block of rank (r - t) mod c and posts the
    transfer of that block to rank r+1 before computing on it, so communication overlaps
    compute. Backward sends the blocks round again, each with its dK/dV accumulator, which
    collects every rank's contribution and arrives home after the last step.
  * "all_gather": gather every block at once, and re-gather in backward, where dK/dV of all
    blocks are reduce-scattered home. Simpler, no overlap, c blocks in memory at a time.
Both save only this rank's q, k, v, output and lse for backward (memory O(s/c)), never a
received block, and compute every block's gradients from the global output and lse
(`flash_attention_block_backward`).
"""

from __future__ import annotations

import math

import torch

from kernels import triton_support
from kernels.flash_attention import flash_attention_block, flash_attention_block_backward, merge_attention_blocks
from megatron.core.context_parallel.comm import Ring, all_gather, group_rank, group_size, reduce_scatter
from megatron.core.context_parallel.sharding import chunk_ids

COMM_TYPES = ("p2p", "all_gather")


def visible_pairs(q_rank: int, kv_rank: int, cp_size: int) -> list[tuple[int, int, bool]]:
    """(local query chunk, held key chunk, causal) for each chunk pair with visible keys, when
    rank `q_rank`'s queries meet rank `kv_rank`'s keys (chunks indexed 0, 1 in local order)."""
    return [
        (qi, ki, kc == qc)
        for qi, qc in enumerate(chunk_ids(q_rank, cp_size))
        for ki, kc in enumerate(chunk_ids(kv_rank, cp_size))
        if kc <= qc
    ]


def _accumulator_dtype(dtype):
    return torch.promote_types(dtype, torch.float32)


def _attend(q, kv, pairs, acc, scale, impl):
    """Merge the local queries' attention against block kv = [k, v] into acc, one (out, lse)
    per query chunk (None before its first block)."""
    q_chunks = q.chunk(2, dim=1)
    k_chunks, v_chunks = kv[0].chunk(2, dim=1), kv[1].chunk(2, dim=1)
    for qi, ki, causal in pairs:
        out, lse = flash_attention_block(q_chunks[qi], k_chunks[ki], v_chunks[ki], causal, scale, impl)
        out = out.to(_accumulator_dtype(out.dtype))
        acc[qi] = (out, lse) if acc[qi] is None else merge_attention_blocks(*acc[qi], out, lse)


def _attend_backward(q, dout, out, lse, kv, pairs, dq, scale, impl):
    """Add block kv's share of the query gradient into dq; return the block's [dk, dv]."""
    q_chunks, dout_chunks, out_chunks = (t.chunk(2, dim=1) for t in (q, dout, out))
    lse_chunks, dq_chunks = lse.chunk(2, dim=2), dq.chunk(2, dim=1)
    k_chunks, v_chunks = kv[0].chunk(2, dim=1), kv[1].chunk(2, dim=1)
    dkv = torch.zeros(kv.shape, dtype=dq.dtype, device=kv.device)
    dk_chunks, dv_chunks = dkv[0].chunk(2, dim=1), dkv[1].chunk(2, dim=1)
    for qi, ki, causal in pairs:
        dq_part, dk_part, dv_part = flash_attention_block_backward(
            q_chunks[qi],
            k_chunks[ki],
            v_chunks[ki],
            out_chunks[qi],
            lse_chunks[qi],
            dout_chunks[qi],
            causal,
            scale,
            impl,
        )
        dq_chunks[qi].add_(dq_part)
        dk_chunks[ki].add_(dk_part)
        dv_chunks[ki].add_(dv_part)
    return dkv


def _finish(acc, dtype):
    """Output [b, s_local, h, d] in the input dtype and lse [b, h, s_local] from the two chunks."""
    return torch.cat([acc[0][0], acc[1][0]], dim=1).to(dtype), torch.cat([acc[0][1], acc[1][1]], dim=2)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a compact copy of it when it is a view into a larger tensor. The attention's v (and k
    without rotary embeddings) is a slice of the fused QKV projection's output: saving the slice would
    keep that whole output alive until backward, (a + 2g) d per token where v alone is g d."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.contiguous()


def _save_for_backward(ctx, acc, q, k, v, group, scale, impl):
    """Finish the merged output; keep only this rank's q, k, v (each in storage of its own), output
    and lse for backward."""
    out, lse = _finish(acc, q.dtype)
    ctx.save_for_backward(*(_own_storage(t) for t in (q, k, v)), out, lse)
    ctx.group, ctx.scale, ctx.impl = group, scale, impl
    return out


def _shape_only_accumulator(q):
    """What the block loop leaves for shape-only (fake) inputs, which have no values to attend over:
    an (out, lse) of each query chunk in the accumulator's dtype, so `_save_for_backward` saves what
    a real forward saves (the memory estimator traces this)."""
    b, s, h, _ = q.shape
    return [
        (
            q.new_empty((b, s // 2) + tuple(q.shape[2:]), dtype=_accumulator_dtype(q.dtype)),
            q.new_empty((b, h, s // 2), dtype=torch.float32),
        )
        for _ in range(2)
    ]


def _backward_inputs(ctx, dout):
    """(q, k, v, out, lse, dout, a zero fp32 dq, cp size, cp rank) for either backward."""
    q, k, v, out, lse = ctx.saved_tensors
    dq = torch.zeros(q.shape, dtype=_accumulator_dtype(q.dtype), device=q.device)
    return q, k, v, out, lse, dout.contiguous(), dq, group_size(ctx.group), group_rank(ctx.group)


class _RingAttention(torch.autograd.Function):
    """The p2p ring. dK/dV accumulators travel in fp32: summing c partial gradients in bf16
    would lose precision at every hop."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, impl):
        if triton_support.shape_only(q):
            return _save_for_backward(ctx, _shape_only_accumulator(q), q, k, v, group, scale, impl)
        cp, me = group_size(group), group_rank(group)
        ring = Ring(group) if cp > 1 else None
        kv = torch.stack([k, v])  # one message carries K and V
        acc = [None, None]
        for step in range(cp):
            transfer = ring.exchange(kv) if step < cp - 1 else None
            _attend(q, kv, visible_pairs(me, (me - step) % cp, cp), acc, scale, impl)
            if transfer is not None:
                kv = transfer.wait()
        return _save_for_backward(ctx, acc, q, k, v, group, scale, impl)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, dout, dq, cp, me = _backward_inputs(ctx, dout)
        ring = Ring(ctx.group) if cp > 1 else None
        kv = torch.stack([k, v])
        own_dkv, dkv_transfer = None, None
        for step in range(cp):
            kv_transfer = ring.exchange(kv) if step < cp - 1 else None
            dkv = _attend_backward(
                q, dout, out, lse, kv, visible_pairs(me, (me - step) % cp, cp), dq, ctx.scale, ctx.impl
            )
            if step == 0:
                own_dkv = dkv  # stays here; the other ranks' shares of it arrive after the last step
            else:
                if dkv_transfer is not None:  # what earlier ranks added to this block's gradient
                    dkv += dkv_transfer.wait()
                dkv_transfer = ring.exchange(dkv)
            if kv_transfer is not None:
                kv = kv_transfer.wait()
        if dkv_transfer is not None:
            own_dkv += dkv_transfer.wait()
        return dq.to(q.dtype), own_dkv[0].to(k.dtype), own_dkv[1].to(v.dtype), None, None, None


def _gather_blocks(k, v, group):
    """[c, 2, b, s_local, h_kv, d]: every cp rank's [k, v]."""
    kv = torch.stack([k, v])
    return all_gather(kv, group) if group_size(group) > 1 else kv[None]


class _AllGatherAttention(torch.autograd.Function):
    """All-gather K/V forward; re-gather in backward (rather than keep c blocks alive between
    forward and backward) and reduce-scatter dK/dV."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, impl):
        if triton_support.shape_only(q):
            return _save_for_backward(ctx, _shape_only_accumulator(q), q, k, v, group, scale, impl)
        cp, me = group_size(group), group_rank(group)
        acc = [None, None]
        for rank, kv in enumerate(_gather_blocks(k, v, group)):
            _attend(q, kv, visible_pairs(me, rank, cp), acc, scale, impl)
        return _save_for_backward(ctx, acc, q, k, v, group, scale, impl)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, dout, dq, cp, me = _backward_inputs(ctx, dout)
        dkv = torch.stack(
            [
                _attend_backward(q, dout, out, lse, kv, visible_pairs(me, rank, cp), dq, ctx.scale, ctx.impl)
                for rank, kv in enumerate(_gather_blocks(k, v, ctx.group))
            ]
        )
        dkv = reduce_scatter(dkv, ctx.group) if cp > 1 else dkv[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def context_parallel_attention(q, k, v, cp_group, comm_type="p2p", impl="auto", softmax_scale=None):
    """Causal attention of this cp rank's queries against the whole sequence.

    q [b, s_local, h, d], k/v [b, s_local, h_kv, d] (h a multiple of h_kv) hold this rank's two
    load-balanced chunks (`sharding.shard` of the full-sequence tensors, with positions from
    `sharding.positions` applied before, e.g. rotary). Returns [b, s_local, h, d]: this rank's
    rows of the full causal attention. `cp_group` None means no context parallelism.
    impl: 'torch' | 'triton' | 'auto', as `kernels.flash_attention.flash_attention_block`.
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"comm_type must be one of {COMM_TYPES}, got {comm_type!r}")
    triton_support.check_impl(impl)
    # checked here, before any rank posts a transfer, rather than by the first block call
    if (
        q.dim() != 4
        or k.dim() != 4
        or k.shape != v.shape
        or q.shape[:2] != k.shape[:2]
        or q.shape[3] != k.shape[3]
        or q.shape[2] % k.shape[2]
        or q.shape[1] % 2
    ):
        raise ValueError(
            f"expected q [b, s_local, h, d] and k, v [b, s_local, h_kv, d] with h a multiple of h_kv "
            f"and s_local even (two chunks); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    function = _RingAttention if comm_type == "p2p" else _AllGatherAttention
    return function.apply(q, k, v, cp_group, scale, impl)
