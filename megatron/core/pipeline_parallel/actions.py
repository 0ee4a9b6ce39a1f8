"""The vocabulary of schedules: compute and transfer actions, steps, and a transfer's peer rank."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from megatron.core.pipeline_parallel.placement import Placement


class ActionKind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_FORWARD = "SF"
    RECV_FORWARD = "RF"
    SEND_BACKWARD = "SB"
    RECV_BACKWARD = "RB"
    WEIGHT = "W"

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT)

    @property
    def to_next_stage(self) -> bool:
        """A transfer with the next stage (forward output out, output gradient in)."""
        return self in (ActionKind.SEND_FORWARD, ActionKind.RECV_BACKWARD)


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    microbatch: int
    chunk: int  # local model chunk on the rank that runs the action, 0..v-1

    def __str__(self) -> str:
        return f"{self.kind.name}(mb={self.microbatch}, chunk={self.chunk})"


Step = list[Action]

# the order of transfers within one batch, the same on both sides of every pair of ranks
BATCH_ORDER = (ActionKind.SEND_FORWARD, ActionKind.RECV_FORWARD, ActionKind.SEND_BACKWARD, ActionKind.RECV_BACKWARD)


def peer_rank(action: Action, rank: int, placement: Placement) -> int:
    """The pipeline rank on the other end of transfer `action` run by `rank`: the rank of the
    next stage (forward output, output gradient) or of the previous one (input, input gradient)."""
    if action.kind.is_compute:
        raise ValueError(f"{action.kind.name} is a compute action and has no peer rank")
    return placement.neighbour(rank, action.chunk, +1 if action.kind.to_next_stage else -1)[0]
