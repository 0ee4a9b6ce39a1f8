"""Run pipeline schedules (action lists) without processes: timing, bubble, deadlock.

The simulator follows the executor's semantics exactly:

* a compute step takes `forward_time` or `backward_time` and nothing else;
* a transfer step posts all its ops at once and completes when every op has
  met its peer op; transfers take no time, so the step ends when the last of
  its peers has posted;
* messages between an ordered pair of ranks meet in posting order, whatever
  their direction (the stricter NCCL rule; a transport matching by tag per
  direction accepts everything this accepts).

On top of timing it checks that the lists are consistent: each send meets the
receive of the same microbatch on the next (forward) or previous (backward)
stage, a forward runs after its input arrived, a backward after its forward
and its output gradient, nothing runs twice. Any violation, and any deadlock,
raises `ScheduleError` with a one-line description.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from megatron.core.pipeline_parallel.schedules import Action, ActionKind, Step, build_schedule, peer_rank

_FORWARD_MSG = (ActionKind.SEND_FORWARD, ActionKind.RECV_FORWARD)
_SENDS = (ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD)
_TO_NEXT_STAGE = (ActionKind.SEND_FORWARD, ActionKind.RECV_BACKWARD)


class ScheduleError(RuntimeError):
    """The action lists deadlock or are inconsistent with each other."""


@dataclass(frozen=True)
class Event:
    """One compute action as it ran: on `rank` from `start` to `end`."""

    rank: int
    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class Timeline:
    """Compute events per rank, in the order each rank ran them. Time 0 is the iteration start."""

    p: int
    v: int
    events: tuple[tuple[Event, ...], ...]

    @property
    def makespan(self) -> float:
        return max((e.end for rank_events in self.events for e in rank_events), default=0.0)


@dataclass
class _Posted:
    rank: int
    step: int
    action: Action
    time: float
    met_at: float | None = None


class _Simulator:
    def __init__(self, schedules: list[list[Step]], v: int, forward_time: float, backward_time: float):
        self.schedules, self.p, self.v = schedules, len(schedules), v
        self.duration = {ActionKind.FORWARD: forward_time, ActionKind.BACKWARD: backward_time}
        self.pos = [0] * self.p
        self.clock = [0.0] * self.p
        self.posted: list[list[_Posted] | None] = [None] * self.p
        self.channels: dict[tuple[int, int], tuple[list[_Posted], list[_Posted]]] = defaultdict(lambda: ([], []))
        self.done = [set() for _ in range(self.p)]  # (kind, mb, chunk) of the actions the rank has run or posted
        self.events: list[list[Event]] = [[] for _ in range(self.p)]
        self.changed = False

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.p + rank

    def run(self) -> Timeline:
        self.changed = True
        while self.changed:
            self.changed = False
            for rank in range(self.p):
                while self._advance(rank):
                    pass
        stuck = [r for r in range(self.p) if self.pos[r] < len(self.schedules[r])]
        if stuck:
            where = "; ".join(f"rank {r} at step {self.pos[r]} {_fmt(self.schedules[r][self.pos[r]])}" for r in stuck)
            raise ScheduleError(f"deadlock: {where}")
        return Timeline(self.p, self.v, tuple(tuple(e) for e in self.events))

    def _fail(self, rank: int, action: Action, why: str) -> ScheduleError:
        return ScheduleError(f"rank {rank} step {self.pos[rank]} {action}: {why}")

    def _advance(self, rank: int) -> bool:
        """Run or complete the rank's current step if it can; return whether it moved on."""
        if self.pos[rank] == len(self.schedules[rank]):
            return False
        step = self.schedules[rank][self.pos[rank]]
        if not step:
            raise ScheduleError(f"rank {rank} step {self.pos[rank]} is empty")
        for a in step:
            if not 0 <= a.chunk < self.v:
                raise self._fail(rank, a, f"chunk out of range [0, {self.v})")
        if step[0].kind.is_compute:
            if len(step) != 1:
                raise ScheduleError(f"rank {rank} step {self.pos[rank]} mixes a computation with others: {_fmt(step)}")
            self._compute(rank, step[0])
        elif not self._transfer(rank, step):
            return False
        self.pos[rank] += 1
        self.changed = True
        return True

    def _compute(self, rank: int, a: Action) -> None:
        first = self.stage(rank, a.chunk) == 0
        last = self.stage(rank, a.chunk) == self.p * self.v - 1
        done = self.done[rank]
        if (a.kind, a.microbatch, a.chunk) in done:
            raise self._fail(rank, a, "runs twice")
        if a.kind is ActionKind.FORWARD and not first and (ActionKind.RECV_FORWARD, a.microbatch, a.chunk) not in done:
            raise self._fail(rank, a, "its input has not been received")
        if a.kind is ActionKind.BACKWARD:
            if (ActionKind.FORWARD, a.microbatch, a.chunk) not in done:
                raise self._fail(rank, a, "runs before its forward")
            if not last and (ActionKind.RECV_BACKWARD, a.microbatch, a.chunk) not in done:
                raise self._fail(rank, a, "its output gradient has not been received")
        start = self.clock[rank]
        self.clock[rank] = start + self.duration[a.kind]
        self.events[rank].append(Event(rank, start, self.clock[rank], a))
        done.add((a.kind, a.microbatch, a.chunk))

    def _transfer(self, rank: int, step: Step) -> bool:
        """Post the step's ops on first visit; return whether all of them have met their peers."""
        if self.posted[rank] is None:
            self.posted[rank] = [self._post(rank, a) for a in step]
            self.changed = True
        ops = self.posted[rank]
        if any(op.met_at is None for op in ops):
            return False
        self.clock[rank] = max(op.met_at for op in ops)
        self.posted[rank] = None
        return True

    def _post(self, rank: int, a: Action) -> _Posted:
        if a.kind.is_compute:
            raise ScheduleError(f"rank {rank} step {self.pos[rank]} mixes a computation with transfers")
        stage = self.stage(rank, a.chunk)
        if a.kind in _TO_NEXT_STAGE and stage == self.p * self.v - 1:
            raise self._fail(rank, a, "the last stage has no next stage")
        if a.kind not in _TO_NEXT_STAGE and stage == 0:
            raise self._fail(rank, a, "the first stage has no previous stage")
        if (a.kind, a.microbatch, a.chunk) in self.done[rank]:
            raise self._fail(rank, a, "runs twice")
        self.done[rank].add((a.kind, a.microbatch, a.chunk))  # the step completes before the next one starts
        forward = a.kind in _FORWARD_MSG
        send = a.kind in _SENDS
        if send:
            computed = ActionKind.FORWARD if forward else ActionKind.BACKWARD
            if (computed, a.microbatch, a.chunk) not in self.done[rank]:
                raise self._fail(rank, a, f"sends before its {computed.name} ran")
        peer = peer_rank(a.kind, rank, self.p)
        sends, recvs = self.channels[(rank, peer) if send else (peer, rank)]
        op = _Posted(rank, self.pos[rank], a, self.clock[rank])
        mine, theirs = (sends, recvs) if send else (recvs, sends)
        mine.append(op)
        if len(theirs) >= len(mine):
            self._meet(*((op, theirs[len(mine) - 1]) if send else (theirs[len(mine) - 1], op)))
        return op

    def _meet(self, send: _Posted, recv: _Posted) -> None:
        s, r = send.action, recv.action
        forward = s.kind is ActionKind.SEND_FORWARD
        target = self.stage(send.rank, s.chunk) + (1 if forward else -1)
        expected = ActionKind.RECV_FORWARD if forward else ActionKind.RECV_BACKWARD
        if r.kind is not expected or r.microbatch != s.microbatch or self.stage(recv.rank, r.chunk) != target:
            raise ScheduleError(
                f"p2p mismatch rank {send.rank} -> {recv.rank}: rank {send.rank} step {send.step} {s} "
                f"met rank {recv.rank} step {recv.step} {r}"
            )
        send.met_at = recv.met_at = max(send.time, recv.time)


def _fmt(step: Step) -> str:
    return "[" + ", ".join(str(a) for a in step) + "]"


def simulate_steps(
    schedules: list[list[Step]], v: int, *, forward_time: float = 1.0, backward_time: float = 2.0
) -> Timeline:
    """Run the action lists of all p = len(schedules) ranks; raise ScheduleError on deadlock or inconsistency."""
    if forward_time <= 0 or backward_time <= 0:
        raise ValueError(f"forward and backward times must be positive, got {forward_time}, {backward_time}")
    return _Simulator(schedules, v, forward_time, backward_time).run()


def simulate(
    p: int,
    v: int,
    m: int,
    *,
    kind: str = "auto",
    group_size: int | None = None,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
) -> Timeline:
    """Build every rank's schedule with `build_schedule` and simulate them together."""
    schedules = [build_schedule(p, v, m, r, kind=kind, group_size=group_size) for r in range(p)]
    return simulate_steps(schedules, v, forward_time=forward_time, backward_time=backward_time)


def bubble_fraction(timeline: Timeline) -> list[float]:
    """Per rank: idle time / busy time, Megatron's "bubble time / ideal time".

    The iteration lasts `timeline.makespan` on every rank (the optimizer step
    waits for the slowest); busy time is the rank's total compute time and idle
    time is the rest. With equal work per rank every rank gets the same value.
    """
    fractions = []
    for rank_events in timeline.events:
        busy = sum(e.end - e.start for e in rank_events)
        fractions.append((timeline.makespan - busy) / busy)
    return fractions


def analytic_bubble_fraction(p: int, v: int, m: int) -> float:
    """Megatron's closed form (Narayanan et al., 2021): (p - 1) / (v * m)."""
    return (p - 1) / (v * m)


def peak_in_flight(steps: list[Step]) -> int:
    """Most (microbatch, chunk) pairs whose forward has run and backward has not, at any point of one rank's list.

    Each holds its stored activations, so this bounds the rank's activation memory.
    """
    live, peak = set(), 0
    for step in steps:
        for a in step:
            if a.kind is ActionKind.FORWARD:
                live.add((a.microbatch, a.chunk))
                peak = max(peak, len(live))
            elif a.kind is ActionKind.BACKWARD:
                live.discard((a.microbatch, a.chunk))
    return peak
