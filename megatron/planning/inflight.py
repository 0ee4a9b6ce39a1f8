"""Activation and p2p-buffer memory over one rank's pipeline schedule (the executor's action list).

Walks `build_schedule(p, v, m, rank)` step by step with the executor's ownership
rules (megatron/core/pipeline_parallel/executor.py):
- FORWARD (mb, c) makes chunk c's saved activations live until BACKWARD (mb, c);
  a non-last chunk's output tensor lives until its SEND_FORWARD step completes;
- RECV_FORWARD allocates the input buffer, counted as a p2p buffer until the
  forward consumes it (from then on it is part of that chunk's activations);
- RECV_BACKWARD allocates the output-gradient buffer, alive until the backward ends;
- BACKWARD of a non-first chunk produces the input gradient, alive until SEND_BACKWARD;
- a transfer step allocates all its receives before any send buffer is released;
- at the V placement's turn (zbv, rank p-1) chunk 0's output is chunk 1's input without a
  transfer: a buffer until chunk 1's forward, then part of its activations, and again a buffer
  from chunk 1's backward (whose input gradient waits for chunk 0's backward) to chunk 0's.
The peak is taken over every point, so unequal chunks (the first stage's
embedding, the last stage's logits) and the interleaved order are exact, not
"peak count x largest chunk". A rank's schedule is reduced once to the set of
distinct (microbatches alive per chunk, buffers alive) states it passes
through; any chunk sizes are then evaluated on that set.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megatron.core.pipeline_parallel.placement import Placement
from megatron.core.pipeline_parallel.schedules import ZERO_BUBBLE, ActionKind, build_schedule

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
SF, RF, SB, RB = ActionKind.SEND_FORWARD, ActionKind.RECV_FORWARD, ActionKind.SEND_BACKWARD, ActionKind.RECV_BACKWARD


@dataclass(frozen=True)
class InFlight:
    activations_bytes: int  # peak of saved activations
    peak_with_p2p_bytes: int  # peak of saved activations + live p2p buffers
    peak_microbatches: int  # most (microbatch, chunk) forwards awaiting their backward

    @property
    def p2p_extra_bytes(self) -> int:
        """What p2p buffers add on top of the activation peak."""
        return self.peak_with_p2p_bytes - self.activations_bytes


def profiles(
    steps, v: int, first_chunk: int | None, last_chunk: int | None, turn: tuple[int, int] | None = None
) -> frozenset:
    """Every distinct (microbatches alive per local chunk, p2p buffers alive) the rank passes through,
    taken after each forward, during each backward and inside each transfer step.
    `first_chunk`/`last_chunk`: the local chunk that is the pipeline's first / last stage here, if any;
    `turn`: (chunk, next chunk) when consecutive stages run on this rank (zbv's rank p-1)."""
    counts, buffers, seen = [0] * v, 0, set()
    pending_input, unsent = set(), set()
    for step in steps:
        first = step[0]
        key = (first.microbatch, first.chunk)
        if first.kind is F:
            counts[first.chunk] += 1
            if key in pending_input:  # the received input now belongs to the chunk's activations
                pending_input.discard(key)
                buffers -= 1
            if turn is not None and first.chunk == turn[0]:  # the next chunk's input, handed over
                pending_input.add((first.microbatch, turn[1]))
                buffers += 1
            elif first.chunk != last_chunk:  # the output, until sent
                unsent.add((SF, key))
                buffers += 1
            seen.add((tuple(counts), buffers))
        elif first.kind is B:
            if first.chunk != first_chunk:  # the input gradient, until sent (or handed back)
                unsent.add((SB, key))
                buffers += 1
            seen.add((tuple(counts), buffers))
            counts[first.chunk] -= 1
            if turn is not None and first.chunk == turn[1]:  # its input, still the previous chunk's output
                buffers += 1
            if turn is not None and first.chunk == turn[0]:  # that output, released with its backward
                buffers -= 1
            if first.chunk != last_chunk:  # the received output gradient
                buffers -= 1
        else:
            for action in step:
                if action.kind in (RF, RB):
                    buffers += 1
                    if action.kind is RF:
                        pending_input.add((action.microbatch, action.chunk))
            seen.add((tuple(counts), buffers))
            for action in step:
                sent = (action.kind, (action.microbatch, action.chunk))
                if action.kind in (SF, SB) and sent in unsent:
                    unsent.discard(sent)
                    buffers -= 1
    return frozenset(seen)


def peaks(states: frozenset, chunk_bytes: list[int], p2p_bytes: int, shared_bytes: list[int] | None = None) -> InFlight:
    """`chunk_bytes[c]`: saved bytes of one microbatch on local chunk c; `shared_bytes[c]`: bytes
    that every microbatch of chunk c saves in one storage (alive while any of them is)."""
    shared = shared_bytes or [0] * len(chunk_bytes)
    act = [sum(n * b + (s if n else 0) for n, b, s in zip(counts, chunk_bytes, shared)) for counts, _ in states]
    return InFlight(
        activations_bytes=max(act, default=0),
        peak_with_p2p_bytes=max((a + buffers * p2p_bytes for a, (_, buffers) in zip(act, states)), default=0),
        peak_microbatches=max((sum(counts) for counts, _ in states), default=0),
    )


def equivalent_microbatches(p: int, m: int, group_size: int | None) -> int:
    """A smaller m whose schedule passes through the same set of states: past warm-up the
    schedules repeat the same steady-state pattern, so with the default group size
    any m > 4p visits what 4p + (m mod p) does (checked in tests/unit/test_memory_inflight.py)."""
    return m if group_size is not None or m <= 4 * p else 4 * p + m % p


def rank_profiles(p: int, v: int, m: int, rank: int, group_size: int | None, kind: str = "auto") -> frozenset:
    """`kind`: the schedule; the zero-bubble kinds but zbv hold the activations of the schedule they defer."""
    kind = kind if kind == "zbv" else "auto"
    return _rank_profiles(p, v, equivalent_microbatches(p, m, group_size), rank, group_size, kind)


@functools.lru_cache(maxsize=4096)
def _rank_profiles(p: int, v: int, m: int, rank: int, group_size: int | None, kind: str) -> frozenset:
    steps = build_schedule(p, v, m, rank, group_size=group_size, kind=kind)
    where = Placement.for_schedule(p, v, kind)
    chunks = range(v)
    first = next((c for c in chunks if where.is_first(rank, c)), None)
    last = next((c for c in chunks if where.is_last(rank, c)), None)
    turn = next(((c, where.neighbour(rank, c, 1)[1]) for c in chunks if where.is_local(rank, c, +1)), None)
    return profiles(steps, v, first, last, turn)


def peak_pending_weight_steps(layout, pp_rank: int) -> int:
    """Most WEIGHT steps a zero-bubble schedule leaves pending after their backward at once on
    `pp_rank` (none for the others: a split backward's WEIGHT step follows its backward)."""
    par = layout.parallel
    if par.pipeline_schedule not in ZERO_BUBBLE:
        return 0
    m = equivalent_microbatches(par.pp, layout.num_microbatches, par.microbatch_group_size)
    return _peak_pending(par.pp, par.virtual_stages, m, pp_rank, par.pipeline_schedule, par.microbatch_group_size)


@functools.lru_cache(maxsize=4096)
def _peak_pending(p: int, v: int, m: int, rank: int, kind: str, group_size: int | None) -> int:
    """`peak_pending_weight_steps` of one rank's list, once per schedule (a search estimates the same
    pipeline under many layouts)."""
    pending = peak = 0
    for step in build_schedule(p, v, m, rank, kind=kind, group_size=group_size):
        pending += {B: 1, W: -1}.get(step[0].kind, 0)
        peak = max(peak, pending)
    return peak


def rank_in_flight(layout, pp_rank: int, chunk_bytes: list[int], p2p_bytes: int, shared_bytes: list[int]) -> InFlight:
    states = rank_profiles(
        layout.parallel.pp,
        layout.parallel.virtual_stages,
        layout.num_microbatches,
        pp_rank,
        layout.parallel.microbatch_group_size,
        layout.parallel.pipeline_schedule,
    )
    return peaks(states, chunk_bytes, p2p_bytes, shared_bytes)
