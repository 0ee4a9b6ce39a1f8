"""Forward passes through the pipeline without backward: validation.

The action list is the trivial schedule: every microbatch in order, and for each
the local model chunks in order of their global stage, each as receive (unless the
first stage), forward, send (unless the last stage; neither when the neighbouring stage is
on the same rank, as at the V placement's turn: the output is passed on). Every rank's list follows the
same global order of (microbatch, stage), so each send meets a receive that is
already posted or is the peer's next action: no deadlock, no bubble accounting.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel.executor import StepStats
from megatron.core.pipeline_parallel.microbatch import Microbatch
from megatron.core.pipeline_parallel.placement import Placement


def forward_only_actions(placement: Placement, m: int, rank: int) -> list[tuple[str, int, int]]:
    """(kind, microbatch, local chunk) with kind 'recv', 'forward' or 'send'."""
    actions = []
    for microbatch in range(m):
        for chunk in placement.chunks_in_stage_order(rank):
            if not placement.is_first(rank, chunk) and not placement.is_local(rank, chunk, -1):
                actions.append(("recv", microbatch, chunk))
            actions.append(("forward", microbatch, chunk))
            if not placement.is_last(rank, chunk) and not placement.is_local(rank, chunk, +1):
                actions.append(("send", microbatch, chunk))
    return actions


class ForwardOnlyExecutor:
    """Runs `forward_only_actions` for this rank under no_grad; returns the loss sums as StepStats.

    `chunks[c]` is called as in training; `batch(mb)` returns a Microbatch, read on the first
    and last stage or, with `every_stage_reads`, on every stage (PipelineSpec). p2p runs on the
    pipeline group with global peer ranks.
    """

    def __init__(
        self,
        chunks: list,
        mesh,
        p2p_shape: tuple,
        p2p_dtype: torch.dtype,
        num_microbatches: int,
        every_stage_reads: bool = False,
        schedule: str = "auto",
    ):
        self.chunks, self.mesh = chunks, mesh
        self.p2p_shape, self.p2p_dtype, self.every_stage_reads = p2p_shape, p2p_dtype, every_stage_reads
        self.placement = Placement.for_schedule(mesh.pp_size, len(chunks), schedule)
        self.actions = forward_only_actions(self.placement, num_microbatches, mesh.pp_rank)

    @torch.no_grad()
    def run(self, batch) -> StepStats:
        device = next(self.chunks[0].parameters()).device
        stats = StepStats.zeros(device)
        rank, where = self.mesh.pp_rank, self.placement
        hidden = {}  # (microbatch, local chunk) -> its input (received or handed over), then its output to send
        for kind, microbatch, chunk in self.actions:
            if kind == "recv":
                buffer = torch.empty(self.p2p_shape, dtype=self.p2p_dtype, device=device)
                dist.recv(buffer, self._peer(chunk, -1), group=self.mesh.pp_group)
                hidden[(microbatch, chunk)] = buffer
            elif kind == "send":
                dist.send(hidden.pop((microbatch, chunk)).contiguous(), self._peer(chunk, +1), group=self.mesh.pp_group)
            else:
                first, last = where.is_first(rank, chunk), where.is_last(rank, chunk)
                data = Microbatch(*batch(microbatch)) if first or last or self.every_stage_reads else None
                model_inputs = data.model_inputs() if data is not None else {}
                inputs = data.tokens if first else hidden.pop((microbatch, chunk))
                if not last:
                    output = self.chunks[chunk](inputs, **model_inputs)
                    following = where.neighbour(rank, chunk, +1)
                    hidden[(microbatch, following[1] if following[0] == rank else chunk)] = output
                    continue
                token_losses = self.chunks[chunk](inputs, data.labels, **model_inputs)
                stats.add_loss(token_losses, data.loss_mask)
        return stats

    def _peer(self, chunk: int, offset: int) -> int:
        """Global rank of the rank holding the stage `offset` from local `chunk`."""
        peer = self.placement.neighbour(self.mesh.pp_rank, chunk, offset)[0]
        return self.mesh.pp_peer(peer - self.mesh.pp_rank)
