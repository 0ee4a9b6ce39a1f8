"""The makespan of one pipeline schedule under many durations, without simulating it again.

The simulator (pipeline_simulator.py) fixes every time by one of four rules: a computation
starts at max(the rank's clock, the completion of the batch that received its input) and
lasts its duration; a batch is posted at the rank's clock, starts at max(its posting, the
completion of the rank's previous batch) and completes at max(its start, its peers' starts)
plus the transfer time. Which times each rule reads (how sends meet receives) and the order
in which the simulator can apply the rules depend on the action lists alone, not on the
durations. So the simulator runs a schedule once, checking its lists and recording that order
(its tape), and the planner's durations replay the tape: the same max and + on the same
operands, hence the same floats as a full simulation (tests/unit/test_makespan.py), without
building the lists or checking them again.
"""

from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass

from megatron.core.pipeline_parallel.schedules import ActionKind
from megatron.planning.pipeline_simulator import checked_weight_time, simulate

_COMPUTE, _POST, _START, _COMPLETE = range(4)
_KIND = {ActionKind.FORWARD: 0, ActionKind.BACKWARD: 1, ActionKind.WEIGHT: 2}


@dataclass(frozen=True)
class Tape:
    """The simulator's timing rules in the order it applied them, over numbered batches, as four
    columns (`code`, `a`, `b`, `c`): (_COMPUTE, rank, kind 0/1/2 for F/B/W, batch of its input or -1),
    (_POST, rank, batch, 0), (_START, batch, the rank's previous batch or -1, 0), (_COMPLETE, batch,
    the first of its peers' batches in `peers`, their number)."""

    ranks: int
    batches: int
    split: bool  # WEIGHT steps run apart: a BACKWARD takes the backward time less the weight time
    code: array
    a: array
    b: array
    c: array
    peers: array

    def makespan(self, forward: float, backward: float, transfer: float, weight: float) -> float:
        """The simulated makespan with these durations (`weight`: already checked and defaulted)."""
        duration = (forward, backward - weight if self.split else backward, weight)
        clock = [0.0] * self.ranks
        posted, started, completed = [0.0] * self.batches, [0.0] * self.batches, [0.0] * self.batches
        peers = self.peers
        for code, a, b, c in zip(self.code, self.a, self.b, self.c):
            if code == _COMPUTE:
                start = clock[a] if c < 0 else max(clock[a], completed[c])
                clock[a] = start + duration[b]
            elif code == _POST:
                posted[b] = clock[a]
            elif code == _START:
                started[a] = max(posted[a], completed[b] if b >= 0 else 0.0)
            else:
                completed[a] = max([started[a], *(started[peer] for peer in peers[b : b + c])]) + transfer
        return max(clock, default=0.0)


def record(p: int, v: int, m: int, kind: str, group_size: int | None) -> Tape:
    """Simulate the schedule once (any valid durations) and number its tape."""
    raw: list = []
    simulate(p, v, m, kind=kind, group_size=group_size, tape=raw)
    number: dict[int, int] = {}

    def index(batch) -> int:
        return -1 if batch is None else number.setdefault(id(batch), len(number))

    columns = [array("q") for _ in range(4)]
    peers = array("q")
    for name, first, *rest in raw:
        if name == "compute":
            rule = (_COMPUTE, first, _KIND[rest[0]], index(rest[1]))
        elif name == "post":
            rule = (_POST, first, index(rest[0]), 0)
        elif name == "start":
            rule = (_START, index(first), index(rest[0]), 0)
        else:
            rule = (_COMPLETE, index(first), len(peers), len(rest[0]))
            peers.extend(index(peer) for peer in rest[0])
        for column, value in zip(columns, rule):
            column.append(value)
    code, a, b, c = columns
    split = any(k == _COMPUTE and kind == _KIND[ActionKind.WEIGHT] for k, kind in zip(code, b))
    return Tape(p, len(number), split, code, a, b, c, peers)


@functools.lru_cache(maxsize=16)  # a tape of p 64, m 192 (121,536 rules) holds 4 MB
def _tape(p: int, v: int, m: int, kind: str, group_size: int | None) -> Tape:
    return record(p, v, m, kind, group_size)


def makespan(
    p: int,
    v: int,
    m: int,
    *,
    kind: str = "auto",
    group_size: int | None = None,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    transfer_time: float = 0.0,
    weight_time: float | None = None,
) -> float:
    """`simulate(p, v, m, ...).makespan` (same arguments, same float), the schedule's lists built and
    simulated once per (p, v, m, kind, group size)."""
    weight = checked_weight_time(forward_time, backward_time, transfer_time, weight_time)
    return _tape(p, v, m, kind, group_size).makespan(forward_time, backward_time, transfer_time, weight)
