"""Communication of context parallelism: the K/V ring (non-blocking p2p) and the collectives of
the all-gather variant, all on the cp group that the caller passes in.

Each call adds the bytes it moves to `COMM_STATS`, as the tensor-parallel collectives do, so
benchmarks compare the volume really communicated with the analytic one: "p2p" counts the bytes
this rank sends, "all_gather" a gather's full output and "reduce_scatter" its full input.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.distributed import collectives
from megatron.core.tensor_parallel.mappings import CommStats

COMM_STATS = CommStats()


def group_size(group) -> int:
    """Ranks in the cp group; None means no context parallelism."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


class Transfer:
    """A posted send/receive pair; `wait` returns the received tensor once it has arrived."""

    def __init__(self, works, sent: torch.Tensor, received: torch.Tensor):
        self._works, self._received = works, received
        self._sent = sent  # the send buffer stays alive until the transfer is waited on

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        return self._received


class Ring:
    """This rank's neighbours in the cp group: blocks go to the next cp rank and come from the
    previous one. P2P ops take global ranks, hence the translation from group ranks."""

    def __init__(self, group):
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank(group)
        self.group = group
        self.next, self.prev = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]

    def exchange(self, x: torch.Tensor) -> Transfer:
        """Post sending x to the next rank and receiving a tensor like x from the previous one;
        returns at once so the caller computes while the block travels."""
        x = x.contiguous()
        received = torch.empty_like(x)
        COMM_STATS.add("p2p", x)
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, x, self.next, self.group), dist.P2POp(dist.irecv, received, self.prev, self.group)]
        )
        return Transfer(works, x, received)


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """[c, *x.shape]: every cp rank's x, stacked in cp rank order."""
    out = x.new_empty((group_size(group) * x.shape[0],) + tuple(x.shape[1:]))  # gloo wants them concatenated
    COMM_STATS.add("all_gather", out)
    collectives.all_gather_single(out, x.contiguous(), group=group)
    return out.view((group_size(group),) + tuple(x.shape))


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over cp ranks of x[cp_rank] from a [c, ...] tensor."""
    out = x.new_empty(tuple(x.shape[1:]))
    COMM_STATS.add("reduce_scatter", x)
    collectives.reduce_scatter_single(out, x.flatten(0, 1).contiguous(), group=group)
    return out
