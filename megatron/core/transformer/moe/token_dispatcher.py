"""Token dispatchers: tokens to the ranks holding their experts and the outputs back (megatron-core's
MoEAllGatherTokenDispatcher and MoEAlltoAllTokenDispatcher).

- allgather: every rank of the expert-tensor x expert-parallel group gathers the group's tokens (and routing),
  runs its local experts on the rows routed to them and the outputs are reduce-scattered back; each rank sends
  and receives the group's whole activation, whatever the routing.
- alltoall: each rank sends every routed row (a token once per chosen expert) only to the rank that holds that
  expert and gets the rows back, with uneven sizes taken from the routing (no padding to the worst case).

Rows enter the experts grouped by local expert; a dispatch returns what its combine needs to undo it. Rows are
gathered from the tokens and summed back by gathers in a fixed order (kernels/moe_permute.py), forward and
backward, so the layer is deterministic on CUDA too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.moe_permute import permute_rows, unpermute_rows
from megatron.core.distributed import collectives
from megatron.core.tensor_parallel.mappings import (
    COMM_STATS,
    all_gather_sequence,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.routing import expert_capacity


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


@dataclass
class HostSyncs:
    """Reads of routing data to the host (each a device sync) since `reads` was last reset."""

    reads: int = 0


HOST_SYNCS = HostSyncs()


def host_counts(counts: torch.Tensor) -> list[list[int]]:
    """Routes per (source rank, expert), counts [sources, experts], read to the host in one sync (counted in
    HOST_SYNCS): the alltoall dispatch's split sizes, as Megatron reads them, and the expert loop's rows per expert.
    The only value an MoE layer takes from the routing to the host, so that the memory estimate's trace
    (megatron/planning/moe_routing.py) can stand in a routing for it."""
    HOST_SYNCS.reads += 1
    return counts.tolist()


def allgather_row_bound(config, tokens: int, sources: int, local: int) -> int:
    """The rows the allgather dispatcher gives `local` experts without reading the routing to the host: every
    route `sources` ranks of `tokens` tokens each can send them (top-k per token, or the local experts if fewer),
    at most the experts' capacity, which padding fills exactly."""
    routes = sources * tokens * min(config.moe_router_topk, local)
    if config.moe_expert_capacity_factor is None:
        return routes
    capacity = (
        sources
        * local
        * expert_capacity(tokens * config.moe_router_topk, config.num_moe_experts, config.moe_expert_capacity_factor)
    )
    return capacity if config.moe_pad_expert_input_to_capacity else min(routes, capacity)


@dataclass
class Permutation:
    """Where each routed row of a dispatch comes from: `token_of_row` [rows] (-1: a padding row), and `slots`
    [tokens, k] the rows of each token in expert order (-1: none), which the combine sums in that order; both
    int32."""

    token_of_row: torch.Tensor
    slots: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.slots.shape[0]


def max_routes(config) -> int:
    """Routes of one token: its top-k, or any expert when padding to capacity adds routes of weight 0."""
    return config.num_moe_experts if config.moe_pad_expert_input_to_capacity else config.moe_router_topk


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor, num_rows: int, max_routes: int):
    """Rows grouped by expert (expert 0's tokens first, each group in token order), their routing weights and the
    Permutation. tokens [T, h], routing_map and probs [T, E]; `num_rows`: the routes in the map, or a bound on them
    (rows past the routes are padding: zero, weight 0); `max_routes`: a bound on the routes of one token (top-k, or
    the experts when capacity padding adds routes). No value is read back to the host."""
    num_tokens, num_experts = routing_map.shape
    by_expert = routing_map.T  # [E, T], expert-major
    expert_token = by_expert.nonzero_static(size=num_rows, fill_value=-1)  # [rows, 2]: (expert, token), -1: padding
    token_of_row = expert_token[:, 1].to(torch.int32)
    row_of_route = by_expert.reshape(-1).cumsum(0, dtype=torch.int32).view(num_experts, num_tokens).T
    row_of_route = torch.where(routing_map, row_of_route - 1, -1)
    k = min(max_routes, num_experts)
    slots = row_of_route if k == num_experts else row_of_route.topk(k, dim=1, sorted=True).values  # rows descending
    permutation = Permutation(token_of_row, slots.contiguous())
    row_probs = torch.where(token_of_row >= 0, probs[expert_token[:, 1], expert_token[:, 0]], 0)
    return permute_rows(tokens, token_of_row, permutation.slots), row_probs, permutation


def unpermute(rows: torch.Tensor, permutation: Permutation) -> torch.Tensor:
    """Sum each token's rows back into place, in a fixed order: [T, h] (zero for a token no row came from)."""
    return unpermute_rows(rows, permutation.token_of_row, permutation.slots)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (input_splits, output_splits), group
        x = x.contiguous()
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        COMM_STATS.add("all_to_all", x)
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, *ctx.splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows [sum(input_splits), ...]: input_splits[r] go to rank r, output_splits[r] come from it (autograd)."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


@dataclass
class _Dispatched:
    permutation: Permutation
    shape: torch.Size
    chunk_sizes: list[int] | None = None  # alltoall: rows per (source rank, local expert)
    splits: tuple[list[int], list[int]] | None = None  # alltoall: (rows received, rows sent) per ep rank
    gathered: list[int] | None = None  # alltoall: rows gathered from each etp rank


class AllGatherDispatcher:
    """Gathers over `group` (expert tensor x expert parallel); this rank's experts are `local_ids`. `sync_free`
    (grouped experts, which take rows per expert on the device): no host read; the rows are `allgather_row_bound`,
    those past the routed ones padding (exact with one expert-parallel rank, dropless or padded; ep x the routed
    rows at most with more). Else the routed rows exactly, their counts read to the host once."""

    def __init__(self, local_ids: range, config, group=None, sync_free: bool = False):
        self.local_ids, self.config, self.group, self.sync_free = local_ids, config, group, sync_free
        self.max_routes = max_routes(config)

    def dispatch(self, hidden, probs, routing_map):
        """hidden [s, b, h], probs and routing_map [s*b, E] -> (rows, rows per local expert, row weights, handle)."""
        shape = hidden.shape
        tokens = hidden.reshape(-1, shape[-1])
        sources = _size(self.group)
        if sources > 1:
            routing_map = all_gather_sequence(routing_map.to(torch.uint8), self.group).bool()
            probs = gather_from_sequence_parallel_region(probs, self.group)
            tokens = gather_from_sequence_parallel_region(tokens, self.group)
        lo, hi = self.local_ids.start, self.local_ids.stop
        local_map = routing_map[:, lo:hi]
        if self.sync_free:
            counts = local_map.sum(dim=0)  # on the device
            num_rows = allgather_row_bound(self.config, tokens.shape[0] // sources, sources, hi - lo)
        else:
            per_source = host_counts(local_map.reshape(sources, -1, hi - lo).sum(dim=1))  # gathered in rank order
            counts = [sum(column) for column in zip(*per_source)]
            num_rows = sum(counts)
        rows, row_probs, permutation = permute(tokens, local_map, probs[:, lo:hi], num_rows, self.max_routes)
        return rows, counts, row_probs, _Dispatched(permutation, shape)

    def combine(self, rows: torch.Tensor, handle: _Dispatched, dtype: torch.dtype) -> torch.Tensor:
        """Expert outputs back to [s, b, h] on the ranks that routed them (summed over ranks and partial shards,
        in `dtype`: the routing weights' precision, as Megatron reduces)."""
        out = unpermute(rows, handle.permutation)
        if _size(self.group) > 1:
            out = reduce_scatter_to_sequence_parallel_region(out.to(dtype), self.group).to(rows.dtype)
        return out.view(handle.shape)


class _GatherUneven(torch.autograd.Function):
    """All-gather along dim 0 of pieces of different sizes (`sizes[r]` rows from rank r), as an all-to-all that
    sends this rank's piece to every rank; backward sums each rank's gradient piece (an uneven reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        n = len(sizes)
        COMM_STATS.add("all_gather", x.new_empty((sum(sizes),) + tuple(x.shape[1:])))
        out = x.new_empty((sum(sizes),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous().repeat((n,) + (1,) * (x.dim() - 1)), sizes, [x.shape[0]] * n, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_uneven(grad, ctx.sizes, ctx.group), None, None


def _reduce_scatter_uneven(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Sum over ranks of each rank's `sizes[r]`-row piece of x, delivered to rank r (no autograd)."""
    rank, n = dist.get_rank(group), len(sizes)
    COMM_STATS.add("reduce_scatter", x)
    out = x.new_empty((n * sizes[rank],) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), [sizes[rank]] * n, sizes, group)
    return out.view(n, sizes[rank], *x.shape[1:]).sum(dim=0)


class _ReduceScatterUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_uneven(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _GatherUneven.apply(grad, ctx.sizes, ctx.group), None, None


class AllToAllDispatcher:
    """Sends each routed row to the expert-parallel rank (`ep_group`) holding its expert, then gathers the rows
    over the expert-tensor-parallel ranks (`etp_group`, which split each expert's weights); `tp_ep_group` is both
    (etp fastest). `local_ids` are this rank's experts, `num_experts` all of them (split evenly over ep in rank
    order)."""

    def __init__(self, local_ids: range, config, ep_group=None, etp_group=None, tp_ep_group=None):
        self.local_ids, self.num_experts, self.max_routes = local_ids, config.num_moe_experts, max_routes(config)
        self.ep_group, self.etp_group, self.tp_ep_group = ep_group, etp_group, tp_ep_group

    def dispatch(self, hidden, probs, routing_map):
        shape = hidden.shape
        tokens = hidden.reshape(-1, shape[-1])
        counts = routing_map.sum(dim=0)
        ep, etp = _size(self.ep_group), _size(self.etp_group)
        if ep * etp == 1:
            table = host_counts(counts.view(1, -1))
        else:  # every rank's counts: rows in tp_ep rank order (etp fastest)
            every_rank = counts.new_empty(ep * etp * self.num_experts)
            collectives.all_gather_single(every_rank, counts, group=self.tp_ep_group)
            table = host_counts(every_rank.view(ep * etp, -1))
        own = table[dist.get_rank(self.tp_ep_group) if ep * etp > 1 else 0]
        rows, row_probs, permutation = permute(tokens, routing_map, probs, sum(own), self.max_routes)
        handle = _Dispatched(permutation, shape)
        lo, hi = self.local_ids.start, self.local_ids.stop
        if ep * etp == 1:
            return rows, own[lo:hi], row_probs, handle
        local = hi - lo
        # mine[t][r][e]: rows this rank's local expert e gets from the rank at etp t, ep r
        mine = [[table[r * etp + t][lo:hi] for r in range(ep)] for t in range(etp)]
        etp_rank = dist.get_rank(self.etp_group) if etp > 1 else 0
        sent = [sum(own[r * local : (r + 1) * local]) for r in range(ep)]
        received = [sum(chunk) for chunk in mine[etp_rank]]
        handle.splits = (received, sent)
        if ep > 1:
            rows = all_to_all(rows, received, sent, self.ep_group)
            row_probs = all_to_all(row_probs, received, sent, self.ep_group)
        if etp > 1:
            handle.gathered = [sum(map(sum, per_ep)) for per_ep in mine]
            rows = _GatherUneven.apply(rows, handle.gathered, self.etp_group)
            row_probs = _GatherUneven.apply(row_probs, handle.gathered, self.etp_group)
        handle.chunk_sizes = [n for per_ep in mine for chunk in per_ep for n in chunk]
        if local > 1:  # (source, expert) order -> (expert, source)
            rows, row_probs = (_reorder(t, handle.chunk_sizes, ep * etp, local) for t in (rows, row_probs))
        per_expert = [sum(chunk[e] for per_ep in mine for chunk in per_ep) for e in range(local)]
        return rows, per_expert, row_probs, handle

    def combine(self, rows: torch.Tensor, handle: _Dispatched, dtype: torch.dtype) -> torch.Tensor:
        if handle.splits is not None:
            ep, etp, local = _size(self.ep_group), _size(self.etp_group), len(self.local_ids)
            if local > 1:
                sizes, sources = handle.chunk_sizes, ep * etp
                by_expert = [sizes[s * local + e] for e in range(local) for s in range(sources)]
                rows = _reorder(rows, by_expert, local, sources)
            if etp > 1:
                rows = _ReduceScatterUneven.apply(rows.to(dtype), handle.gathered, self.etp_group).to(rows.dtype)
            if ep > 1:
                received, sent = handle.splits
                rows = all_to_all(rows, sent, received, self.ep_group)
        return unpermute(rows, handle.permutation).view(handle.shape)


def _reorder(x: torch.Tensor, sizes: list[int], outer: int, inner: int) -> torch.Tensor:
    """Chunks laid out [outer][inner] (sizes in that order) re-laid [inner][outer]."""
    chunks = x.split(sizes)
    return torch.cat([chunks[o * inner + i] for i in range(inner) for o in range(outer)], dim=0)
