"""Where each pipeline stage runs: the one stage <-> (pipeline rank, local model chunk) mapping.

Two placements exist:

* loop (1F1B, interleaved and their zero-bubble variants): chunk c of rank r is global stage
  c * p + r, so the stages go round the ranks v times and every forward message goes to the
  next rank (around the ring from rank p-1 to rank 0);
* V (`zbv`, exactly two chunks per rank): rank r holds stage r (chunk 0) and stage 2p-1-r
  (chunk 1). The stages go down the ranks and back up: forward messages of chunk 0 go to
  rank r+1, those of chunk 1 to rank r-1, and the hand-off from stage p-1 to stage p stays on
  rank p-1 (no transfer). Rank 0 holds both ends: it reads the data and computes the loss.

Every module that needs to know a stage's place (model building and layer assignment, who
reads data and computes the loss, transfer peers, dropout seeds, the simulator, the memory
estimate) asks a `Placement`.
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("loop", "v")


def placement_of(schedule: str) -> str:
    """The placement a schedule kind (schedules.KINDS) runs on."""
    return "v" if schedule == "zbv" else "loop"


@dataclass(frozen=True)
class Placement:
    p: int  # pipeline ranks
    v: int  # model chunks per rank
    kind: str = "loop"

    def __post_init__(self):
        if self.kind not in PLACEMENTS:
            raise ValueError(f"unknown stage placement {self.kind!r}; choose one of {', '.join(PLACEMENTS)}")
        if self.kind == "v" and self.v != 2:
            raise ValueError(f"the V placement holds exactly 2 model chunks per rank, got {self.v}")

    @classmethod
    def for_schedule(cls, p: int, v: int, schedule: str) -> Placement:
        return cls(p, v, placement_of(schedule))

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """Global stage of local chunk `chunk` on pipeline rank `rank`."""
        if self.kind == "v":
            return rank if chunk == 0 else 2 * self.p - 1 - rank
        return chunk * self.p + rank

    def location(self, stage: int) -> tuple[int, int]:
        """(pipeline rank, local chunk) of global stage `stage`."""
        if self.kind == "v":
            return (stage, 0) if stage < self.p else (2 * self.p - 1 - stage, 1)
        return stage % self.p, stage // self.p

    def is_first(self, rank: int, chunk: int) -> bool:
        return self.stage(rank, chunk) == 0

    def is_last(self, rank: int, chunk: int) -> bool:
        return self.stage(rank, chunk) == self.num_stages - 1

    def neighbour(self, rank: int, chunk: int, offset: int) -> tuple[int, int]:
        """(rank, chunk) of the stage `offset` (+1: next, -1: previous) from chunk `chunk` of `rank`."""
        return self.location(self.stage(rank, chunk) + offset)

    def is_local(self, rank: int, chunk: int, offset: int) -> bool:
        """Whether the stage `offset` away runs on the same rank (the V's turn on rank p-1)."""
        stage = self.stage(rank, chunk) + offset
        return 0 <= stage < self.num_stages and self.location(stage)[0] == rank

    def chunks_in_stage_order(self, rank: int) -> list[int]:
        """The rank's local chunks, earliest stage first."""
        return sorted(range(self.v), key=lambda chunk: self.stage(rank, chunk))
