"""Forward passes through the pipeline without backward: validation.

The action list is the trivial schedule: every microbatch in order, and for each
the local model chunks in order of their global stage, each as receive (unless the
first stage), forward, send (unless the last stage). Every rank's list follows the
same global order of (microbatch, stage), so each send meets a receive that is
already posted or is the peer's next action: no deadlock, no bubble accounting.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel.executor import StepStats
from megatron.core.pipeline_parallel.microbatch import Microbatch


def forward_only_actions(p: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """(kind, microbatch, local chunk) with kind 'recv', 'forward' or 'send'."""
    actions = []
    for microbatch in range(m):
        for chunk in range(v):
            stage = chunk * p + rank
            if stage > 0:
                actions.append(("recv", microbatch, chunk))
            actions.append(("forward", microbatch, chunk))
            if stage < p * v - 1:
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
    ):
        self.chunks, self.mesh = chunks, mesh
        self.p2p_shape, self.p2p_dtype, self.every_stage_reads = p2p_shape, p2p_dtype, every_stage_reads
        self.actions = forward_only_actions(mesh.pp_size, len(chunks), num_microbatches, mesh.pp_rank)

    @torch.no_grad()
    def run(self, batch) -> StepStats:
        device = next(self.chunks[0].parameters()).device
        stats = StepStats.zeros(device)
        p, v, rank = self.mesh.pp_size, len(self.chunks), self.mesh.pp_rank
        hidden = {}
        for kind, microbatch, chunk in self.actions:
            stage = chunk * p + rank
            if kind == "recv":
                buffer = torch.empty(self.p2p_shape, dtype=self.p2p_dtype, device=device)
                dist.recv(buffer, self.mesh.pp_peer(-1), group=self.mesh.pp_group)
                hidden[(microbatch, chunk)] = buffer
            elif kind == "send":
                dist.send(hidden.pop((microbatch, chunk)).contiguous(), self.mesh.pp_peer(+1), group=self.mesh.pp_group)
            else:
                first, last = stage == 0, stage == p * v - 1
                data = Microbatch(*batch(microbatch)) if first or last or self.every_stage_reads else None
                model_inputs = data.model_inputs() if data is not None else {}
                inputs = data.tokens if first else hidden.pop((microbatch, chunk))
                if not last:
                    hidden[(microbatch, chunk)] = self.chunks[chunk](inputs, **model_inputs)
                    continue
                token_losses = self.chunks[chunk](inputs, data.labels, **model_inputs)
                stats.add_loss(token_losses, data.loss_mask)
        return stats
