"""Run pipeline schedules (action lists) without processes: timing, bubble, deadlock.

The simulator follows the executor's semantics, under NCCL's strictest reading:

* a compute step takes `forward_time` or `backward_time`; before it starts the
  rank waits for the batch that received its input (forward) or output
  gradient (backward); in split-backward lists a BACKWARD takes
  `backward_time - weight_time` and its WEIGHT step `weight_time`;
* a transfer step posts its ops as one batch and the rank goes on at once;
* a rank's batches run one after another, as on NCCL's one communication
  stream: a batch starts when it is posted and the rank's previous batch has
  completed, and completes `transfer_time` after every op in it has met its
  peer op (so a send holds back the batches posted after it until the
  receiver has posted; gloo, whose ops complete one by one, accepts all this
  accepts);
* messages between an ordered pair of ranks meet in posting order, whatever
  their direction (a transport matching by tag per direction accepts
  everything this accepts).

On top of timing it checks that the lists are consistent: each send meets the
receive of the same microbatch on the next (forward) or previous (backward)
stage, a forward runs after its input was received, a backward after its
forward and its output gradient, a weight step after its backward, nothing
runs twice. Any violation, and any
deadlock, raises `ScheduleError` with a one-line description.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from megatron.core.pipeline_parallel.placement import Placement, placement_of
from megatron.core.pipeline_parallel.schedules import Action, ActionKind, Step, build_schedule, peer_rank

_FORWARD_MSG = (ActionKind.SEND_FORWARD, ActionKind.RECV_FORWARD)
_SENDS = (ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD)
_TO_NEXT_STAGE = (ActionKind.SEND_FORWARD, ActionKind.RECV_BACKWARD)
_CONSUMES = {ActionKind.FORWARD: ActionKind.RECV_FORWARD, ActionKind.BACKWARD: ActionKind.RECV_BACKWARD}


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
class _Batch:
    """One transfer step as posted: it starts once the rank's previous batch has completed."""

    rank: int
    step: int
    posted: float
    ops: list = field(default_factory=list)
    started: float | None = None
    completed: float | None = None


@dataclass
class _Posted:
    batch: _Batch
    action: Action
    peer: _Posted | None = None


class _Simulator:
    def __init__(
        self,
        schedules: list[list[Step]],
        v: int,
        forward_time: float,
        backward_time: float,
        transfer_time: float,
        weight_time: float,
        placement: str,
    ):
        self.schedules, self.p, self.v = schedules, len(schedules), v
        self.placement = Placement(self.p, v, placement)
        split = any(a.kind is ActionKind.WEIGHT for steps in schedules for step in steps for a in step)
        self.duration = {
            ActionKind.FORWARD: forward_time,
            ActionKind.WEIGHT: weight_time,
            ActionKind.BACKWARD: backward_time - weight_time if split else backward_time,
        }
        self.transfer_time = transfer_time
        self.pos = [0] * self.p
        self.clock = [0.0] * self.p
        self.batches: list[list[_Batch]] = [[] for _ in range(self.p)]
        self.pending = [0] * self.p  # index of each rank's first batch that has not completed
        self.received: list[dict] = [{} for _ in range(self.p)]  # (kind, mb, chunk) of a receive -> its batch
        self.channels: dict[tuple[int, int], tuple[list[_Posted], list[_Posted]]] = defaultdict(lambda: ([], []))
        self.done = [set() for _ in range(self.p)]  # (kind, mb, chunk) of the actions the rank has run or posted
        self.events: list[list[Event]] = [[] for _ in range(self.p)]
        self.changed = False
        self.tape: list | None = None  # when a list: the timing rules in the order applied (makespan.py replays it)

    def stage(self, rank: int, chunk: int) -> int:
        return self.placement.stage(rank, chunk)

    def run(self) -> Timeline:
        self.changed = True
        while self.changed:
            self.changed = False
            for rank in range(self.p):
                while self._advance(rank):
                    pass
            self.changed |= self._progress_batches()
        stuck = [
            r
            for r in range(self.p)
            if self.pos[r] < len(self.schedules[r]) or any(b.completed is None for b in self.batches[r])
        ]
        if stuck:
            raise ScheduleError("deadlock: " + "; ".join(self._where(r) for r in stuck))
        return Timeline(self.p, self.v, tuple(tuple(e) for e in self.events))

    def _where(self, rank: int) -> str:
        steps = self.schedules[rank]
        at = (
            f"rank {rank} at step {self.pos[rank]} {_fmt(steps[self.pos[rank]])}"
            if self.pos[rank] < len(steps)
            else f"rank {rank} at the end"
        )
        pending = next((b for b in self.batches[rank] if b.completed is None), None)
        return at + ("" if pending is None else f" waiting for step {pending.step} {_fmt(steps[pending.step])}")

    def _fail(self, rank: int, action: Action, why: str) -> ScheduleError:
        return ScheduleError(f"rank {rank} step {self.pos[rank]} {action}: {why}")

    def _advance(self, rank: int) -> bool:
        """Run the rank's current step if it can; return whether it moved on."""
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
            if not self._compute(rank, step[0]):
                return False
        else:
            self._post_batch(rank, step)
        self.pos[rank] += 1
        self.changed = True
        return True

    def _compute(self, rank: int, a: Action) -> bool:
        """Run a computation once its received tensor has arrived; return whether it ran."""
        first = self.stage(rank, a.chunk) == 0
        last = self.stage(rank, a.chunk) == self.p * self.v - 1
        done = self.done[rank]
        if (a.kind, a.microbatch, a.chunk) in done:
            raise self._fail(rank, a, "runs twice")
        if a.kind is ActionKind.FORWARD and not first and not self._has_input(rank, a, ActionKind.FORWARD, -1):
            raise self._fail(rank, a, "its input has not been received")
        if a.kind is ActionKind.BACKWARD:
            if (ActionKind.FORWARD, a.microbatch, a.chunk) not in done:
                raise self._fail(rank, a, "runs before its forward")
            if not last and not self._has_input(rank, a, ActionKind.BACKWARD, +1):
                raise self._fail(rank, a, "its output gradient has not been received")
        if a.kind is ActionKind.WEIGHT and (ActionKind.BACKWARD, a.microbatch, a.chunk) not in done:
            raise self._fail(rank, a, "runs before its backward")
        start = self.clock[rank]
        batch = self.received[rank].get((_CONSUMES.get(a.kind), a.microbatch, a.chunk))
        if batch is not None:
            if batch.completed is None:
                return False
            start = max(start, batch.completed)
        self.clock[rank] = start + self.duration[a.kind]
        self.events[rank].append(Event(rank, start, self.clock[rank], a))
        if self.tape is not None:
            self.tape.append(("compute", rank, a.kind, batch))
        done.add((a.kind, a.microbatch, a.chunk))
        return True

    def _has_input(self, rank: int, a: Action, computed: ActionKind, offset: int) -> bool:
        """Whether what `a` consumes is here: received, or computed on this rank by the neighbouring
        stage when that stage is local (the V placement's turn on rank p-1 passes it directly)."""
        if self.placement.is_local(rank, a.chunk, offset):
            chunk = self.placement.neighbour(rank, a.chunk, offset)[1]
            return (computed, a.microbatch, chunk) in self.done[rank]
        return (_CONSUMES[a.kind], a.microbatch, a.chunk) in self.done[rank]

    def _post_batch(self, rank: int, step: Step) -> None:
        batch = _Batch(rank, self.pos[rank], self.clock[rank])
        self.batches[rank].append(batch)
        if self.tape is not None:
            self.tape.append(("post", rank, batch))
        batch.ops = [self._post(rank, batch, a) for a in step]

    def _post(self, rank: int, batch: _Batch, a: Action) -> _Posted:
        if a.kind.is_compute:
            raise ScheduleError(f"rank {rank} step {self.pos[rank]} mixes a computation with transfers")
        stage = self.stage(rank, a.chunk)
        if a.kind in _TO_NEXT_STAGE and stage == self.p * self.v - 1:
            raise self._fail(rank, a, "the last stage has no next stage")
        if a.kind not in _TO_NEXT_STAGE and stage == 0:
            raise self._fail(rank, a, "the first stage has no previous stage")
        if (a.kind, a.microbatch, a.chunk) in self.done[rank]:
            raise self._fail(rank, a, "runs twice")
        self.done[rank].add((a.kind, a.microbatch, a.chunk))
        forward = a.kind in _FORWARD_MSG
        send = a.kind in _SENDS
        if send:
            computed = ActionKind.FORWARD if forward else ActionKind.BACKWARD
            if (computed, a.microbatch, a.chunk) not in self.done[rank]:
                raise self._fail(rank, a, f"sends before its {computed.name} ran")
        else:
            self.received[rank][(a.kind, a.microbatch, a.chunk)] = batch
        if self.placement.is_local(rank, a.chunk, +1 if a.kind in _TO_NEXT_STAGE else -1):
            raise self._fail(rank, a, "the neighbouring stage is on this rank: nothing to transfer")
        peer = peer_rank(a, rank, self.placement)
        sends, recvs = self.channels[(rank, peer) if send else (peer, rank)]
        op = _Posted(batch, a)
        mine, theirs = (sends, recvs) if send else (recvs, sends)
        mine.append(op)
        if len(theirs) >= len(mine):
            self._meet(*((op, theirs[len(mine) - 1]) if send else (theirs[len(mine) - 1], op)))
        return op

    def _meet(self, send: _Posted, recv: _Posted) -> None:
        s, r = send.action, recv.action
        forward = s.kind is ActionKind.SEND_FORWARD
        target = self.stage(send.batch.rank, s.chunk) + (1 if forward else -1)
        expected = ActionKind.RECV_FORWARD if forward else ActionKind.RECV_BACKWARD
        if r.kind is not expected or r.microbatch != s.microbatch or self.stage(recv.batch.rank, r.chunk) != target:
            raise ScheduleError(
                f"p2p mismatch rank {send.batch.rank} -> {recv.batch.rank}: rank {send.batch.rank} step "
                f"{send.batch.step} {s} met rank {recv.batch.rank} step {recv.batch.step} {r}"
            )
        send.peer, recv.peer = recv, send

    def _progress_batches(self) -> bool:
        """Start and complete the batches that can, in each rank's posting order; return whether any did."""
        any_moved, moved = False, True
        while moved:
            moved = False
            for rank, batches in enumerate(self.batches):
                while self.pending[rank] < len(batches):
                    batch = batches[self.pending[rank]]
                    if batch.started is None:
                        previous = batches[self.pending[rank] - 1].completed if self.pending[rank] else 0.0
                        batch.started = max(batch.posted, previous)
                        moved = True
                        if self.tape is not None:
                            self.tape.append(
                                ("start", batch, batches[self.pending[rank] - 1] if self.pending[rank] else None)
                            )
                    peers = [op.peer.batch.started for op in batch.ops if op.peer is not None]
                    if len(peers) < len(batch.ops) or None in peers:
                        break
                    batch.completed = max([batch.started, *peers]) + self.transfer_time
                    if self.tape is not None:
                        self.tape.append(("complete", batch, [op.peer.batch for op in batch.ops]))
                    self.pending[rank] += 1
                    moved = True
            any_moved |= moved
        return any_moved


def _fmt(step: Step) -> str:
    return "[" + ", ".join(str(a) for a in step) + "]"


def simulate_steps(
    schedules: list[list[Step]],
    v: int,
    *,
    tape: list | None = None,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    transfer_time: float = 0.0,
    weight_time: float | None = None,
    placement: str = "loop",
) -> Timeline:
    """Run the action lists of all p = len(schedules) ranks; raise ScheduleError on deadlock or inconsistency.

    `placement`: where the stages run (placement.PLACEMENTS; 'v' for zbv).

    `transfer_time`: how long a batch takes once all its ops have met (0: the exact bubble of the
    schedule; above 0: how much of the p2p latency the schedule hides behind computation).
    `weight_time`: the part of `backward_time` a split backward's WEIGHT step takes (default half:
    a linear layer's input and weight gradients are one matrix product each).
    `tape`: a list to append the timing rules to, in the order the simulator applies them (makespan.py)."""
    weight_time = checked_weight_time(forward_time, backward_time, transfer_time, weight_time)
    simulator = _Simulator(schedules, v, forward_time, backward_time, transfer_time, weight_time, placement)
    simulator.tape = tape
    return simulator.run()


def checked_weight_time(forward_time: float, backward_time: float, transfer_time: float, weight_time: float | None):
    """The WEIGHT step's time (default: half the backward); ValueError on durations that cannot be."""
    weight_time = backward_time / 2 if weight_time is None else weight_time
    if forward_time <= 0 or backward_time <= 0 or transfer_time < 0 or not 0 < weight_time < backward_time:
        raise ValueError(
            f"forward and backward times must be positive, the transfer time non-negative and the "
            f"weight time inside the backward time, got {forward_time}, {backward_time}, "
            f"{transfer_time}, {weight_time}"
        )
    return weight_time


def simulate(
    p: int,
    v: int,
    m: int,
    *,
    tape: list | None = None,
    kind: str = "auto",
    group_size: int | None = None,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    transfer_time: float = 0.0,
    split_backward: bool = False,
    weight_time: float | None = None,
) -> Timeline:
    """Build every rank's schedule with `build_schedule` and simulate them together."""
    schedules = [
        build_schedule(p, v, m, r, kind=kind, group_size=group_size, split_backward=split_backward) for r in range(p)
    ]
    return simulate_steps(
        schedules,
        v,
        tape=tape,
        forward_time=forward_time,
        backward_time=backward_time,
        transfer_time=transfer_time,
        weight_time=weight_time,
        placement=placement_of(kind),
    )


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
