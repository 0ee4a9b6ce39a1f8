"""Pipeline schedules as data.

`build_schedule(p, v, m, rank)` returns what one pipeline rank does in one
training iteration as a list of *steps*. A step is either

* exactly one compute action (FORWARD or BACKWARD of one microbatch on one
  local model chunk, or WEIGHT: the weight gradients of a split backward), or
* one or more transfers (SEND_/RECV_ FORWARD/BACKWARD) that the executor
  *posts* as ONE batch and does not wait for. A receive is waited for by the
  compute that consumes it (the forward of its microbatch and chunk, or the
  backward); sends are never waited for before the end of the iteration. So a
  receive posted before other computations overlaps them, and a send never
  holds its rank back.

Where a stage runs is `placement.Placement`'s: in the loop placement of every
schedule here but ZB-V, chunk c on rank r is global stage c*p + r. Stage s sends its forward output to
stage s+1 and its input gradient to stage s-1, so in the loop placement forward messages go
to rank (r+1) % p and backward messages to rank (r-1) % p (ZB-V's V placement: zbv.py). A transfer action
names the microbatch and the *local* chunk on the rank that runs it (the
sender's chunk for a send, the receiver's chunk for a receive). The first stage
reads data (no RECV_FORWARD), the last computes the loss (no SEND_FORWARD, no
RECV_BACKWARD) and the first stage sends no gradient.

Between any two ranks, messages are posted in the same order on both sides, not
only per direction but across directions: when p == 2 both neighbours are one
rank, and a batch may hold a forward and a backward message to it; they are
listed forward first on both sides, so the lists work whether the transport
matches by tag or only by posting order (NCCL). Within a step the order is
SEND_FORWARD, RECV_FORWARD, SEND_BACKWARD, RECV_BACKWARD; the executor posts a batch's sends
first, which keeps each direction's messages in order, all that either transport matches by
within a batch. `megatron/planning/pipeline_simulator.py` checks
on the lists that they match up, cannot deadlock even under NCCL's strictest
reading (a rank's batches run one after another, each completing only when all
its transfers have met their peers), and computes their bubble.

With `split_backward` a BACKWARD computes input gradients only (and the
gradients of parameters that are not linear weights) and its WEIGHT action
computes the linear layers' weight gradients right after the transfer step that
sends the input gradient upstream (zero-bubble pipelining's B/W split, Qi et al.,
2023, without moving W any later): the upstream stage gets its gradient one
weight-gradient computation earlier, which shortens the cool-down's chain of
backwards by (p - 1) weight-gradient times. Compute order otherwise unchanged.

The compute order and the batching of transfers follow Megatron-LM's
`forward_backward_pipelining_without_interleaving` (1F1B) and
`forward_backward_pipelining_with_interleaving` with `overlap_p2p_comm`: in the
interleaved steady state a forward's send goes out in one batch with the
receive for the next forward, posted before the backward that runs in between,
and likewise for backwards. With a group size above p the messages that go
around the ring are received earlier (see `_interleaved_receives`).
"""

from __future__ import annotations

from megatron.core.pipeline_parallel.actions import Action, ActionKind, Step, peer_rank
from megatron.core.pipeline_parallel.zbv import zbv_compute_order, zbv_steps

KINDS = ("auto", "none", "1f1b", "interleaved", "zb-h1", "zbv", "interleaved-zb")
# The zero-bubble kinds that defer the weight-gradient steps of another schedule: that schedule,
# and how many WEIGHT steps rank r may keep pending (see `_defer_weights`).
DEFERRED = {"zb-h1": ("1f1b", lambda rank: rank), "interleaved-zb": ("interleaved", lambda rank: 2 * rank)}
# Every kind that splits each backward into BACKWARD and WEIGHT steps and moves the WEIGHT steps.
ZERO_BUBBLE = (*DEFERRED, "zbv")

__all__ = ["Action", "ActionKind", "Step", "peer_rank"]  # re-exported from actions.py: the schedules' vocabulary


def _validate(p: int, v: int, m: int, rank: int, kind: str, group_size: int | None) -> tuple[str, int]:
    """Check the arguments and resolve 'auto'; return (kind, microbatch group size)."""
    names = ("p (pipeline-model-parallel size)", "v (virtual stages per rank)", "m (microbatches)")
    for name, value in zip(names, (p, v, m)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(rank, int) or not 0 <= rank < p:
        raise ValueError(f"pipeline rank must be in [0, {p}), got {rank!r}")
    if kind not in KINDS:
        raise ValueError(f"unknown schedule kind {kind!r}; choose one of {', '.join(KINDS)}")
    if kind == "auto":
        kind = "none" if p == 1 and v == 1 else "1f1b" if v == 1 else "interleaved"
    if kind in ZERO_BUBBLE and p < 2:
        raise ValueError(f"schedule {kind!r} needs --pipeline-model-parallel-size > 1, got {p}")
    if kind == "zbv":
        if v != 2:
            raise ValueError(f"schedule 'zbv' runs exactly 2 model chunks per rank (V placement), got v={v}")
        if group_size is not None:
            raise ValueError("--microbatch-group-size-per-virtual-pipeline-stage does not apply to schedule 'zbv'")
        return kind, 1
    if kind == "zb-h1" and v != 1:
        raise ValueError(f"schedule 'zb-h1' runs one model chunk per rank, got v={v}; use 'interleaved-zb'")
    if kind == "interleaved-zb":
        return kind, _interleaved_group_size(p, v, m, group_size)
    if kind == "none" and (p != 1 or v != 1):
        raise ValueError(f"schedule 'none' (no pipelining) needs p == 1 and v == 1, got p={p}, v={v}")
    if kind == "1f1b" and v != 1:
        raise ValueError(f"schedule '1f1b' runs one model chunk per rank, got v={v}; use 'interleaved'")
    if kind != "interleaved":
        if group_size is not None:
            raise ValueError(
                "--microbatch-group-size-per-virtual-pipeline-stage only applies to the interleaved schedule (v > 1)"
            )
        return kind, 1
    return kind, _interleaved_group_size(p, v, m, group_size)


def _interleaved_group_size(p: int, v: int, m: int, group_size: int | None) -> int:
    """Check Megatron's conditions on the microbatch group size g and return it.

    A microbatch leaves rank p-1 on chunk c and must be back on rank 0 for
    chunk c+1 one group later; the trip takes p-1 batches, so every group,
    the last one included, needs at least p microbatches (p <= g <= m, and
    m % g is 0 or >= p). Otherwise rank 0 runs out of work and the schedule
    as built would compute a forward before its input arrives.
    """
    if v < 2:
        raise ValueError(f"schedule 'interleaved' needs v >= 2 model chunks per rank, got v={v}; use '1f1b'")
    if p < 2:
        raise ValueError("virtual pipeline stages (v > 1) need --pipeline-model-parallel-size >= 2, got 1")
    if m < p:
        raise ValueError(
            f"the interleaved schedule needs at least as many microbatches as pipeline stages: got {m} microbatches "
            f"for --pipeline-model-parallel-size {p}; raise --global-batch-size or lower --micro-batch-size"
        )
    g = p if group_size is None else group_size
    if not isinstance(g, int) or not p <= g <= m:
        raise ValueError(
            f"--microbatch-group-size-per-virtual-pipeline-stage must be in [{p}, {m}] "
            f"(pipeline-model-parallel size, microbatches), got {g!r}"
        )
    if 0 < m % g < p:
        raise ValueError(
            f"{m} microbatches in groups of {g} (--microbatch-group-size-per-virtual-pipeline-stage) leave a last "
            f"group of {m % g} < {p} (--pipeline-model-parallel-size); make the number of microbatches "
            f"(--global-batch-size / (--micro-batch-size * data-parallel size)) a multiple of the group size "
            f"or pick a group size that leaves >= {p}"
        )
    return g


def num_warmup_microbatches(
    p: int, v: int, m: int, rank: int, *, kind: str = "auto", group_size: int | None = None
) -> int:
    """Forward passes (of one microbatch on one chunk) a rank runs before its first backward.

    1F1B: min(p - rank - 1, m). Interleaved (Megatron):
    min(2 * (p - rank - 1) + (v - 1) * g, v * m). The factor 2: in the
    interleaved steady state a rank is one forward behind its predecessor and,
    gradients travelling the other way, one backward ahead of it.
    The peak number of forwards awaiting their backward is min(warm-up + 1, v * m).
    """
    kind, g = _validate(p, v, m, rank, kind, group_size)
    kind = DEFERRED.get(kind, (kind,))[0]
    if kind == "zbv":
        order = zbv_compute_order(p, m, rank)
        return next(k for k, action in enumerate(order) if action.kind is ActionKind.BACKWARD)
    if kind == "none":
        return 0
    if kind == "1f1b":
        return min(p - rank - 1, m)
    return min(2 * (p - rank - 1) + (v - 1) * g, v * m)


def interleaved_order(m: int, v: int, g: int) -> list[tuple[int, int]]:
    """The forward order of (microbatch, chunk) on every rank of the interleaved schedule.

    Microbatches go in groups of g (the last group holds the m % g left over,
    if any); each group runs through chunk 0, then chunk 1, ... as in
    Megatron's `get_schedule_table`. The backward order is the same with
    chunk c replaced by v - 1 - c.
    """
    return [(mb, c) for first in range(0, m, g) for c in range(v) for mb in range(first, min(first + g, m))]


class _Writer:
    """Appends the steps of one rank, leaving out transfers the stage does not make; with
    `split_backward`, a backward's WEIGHT step follows the transfer step after it, or comes
    before the next computation where none follows."""

    def __init__(self, p: int, v: int, rank: int, split_backward: bool = False):
        self.p, self.v, self.rank = p, v, rank
        self.split_backward = split_backward
        self.weight_pending: tuple[int, int] | None = None
        self.steps: list[Step] = []

    def _first(self, chunk: int) -> bool:
        return self.rank == 0 and chunk == 0

    def _last(self, chunk: int) -> bool:
        return self.rank == self.p - 1 and chunk == self.v - 1

    def forward(self, unit: tuple[int, int]) -> None:
        self.flush_weight()
        self.steps.append([Action(ActionKind.FORWARD, *unit)])

    def backward(self, unit: tuple[int, int]) -> None:
        self.flush_weight()
        self.steps.append([Action(ActionKind.BACKWARD, *unit)])
        if self.split_backward:
            self.weight_pending = unit

    def flush_weight(self) -> list[Step]:
        """Append the pending WEIGHT step, if any; return the steps."""
        if self.weight_pending is not None:
            self.steps.append([Action(ActionKind.WEIGHT, *self.weight_pending)])
            self.weight_pending = None
        return self.steps

    def comm(self, send_forward=None, recv_forward=None, send_backward=None, recv_backward=None) -> None:
        """One batched transfer step; each argument is a (microbatch, chunk) or None."""
        ops = []
        if send_forward is not None and not self._last(send_forward[1]):
            ops.append(Action(ActionKind.SEND_FORWARD, *send_forward))
        if recv_forward is not None and not self._first(recv_forward[1]):
            ops.append(Action(ActionKind.RECV_FORWARD, *recv_forward))
        if send_backward is not None and not self._first(send_backward[1]):
            ops.append(Action(ActionKind.SEND_BACKWARD, *send_backward))
        if recv_backward is not None and not self._last(recv_backward[1]):
            ops.append(Action(ActionKind.RECV_BACKWARD, *recv_backward))
        if ops:
            self.steps.append(ops)
        self.flush_weight()


def _no_pipelining(m: int, split_backward: bool) -> list[Step]:
    """Plain gradient accumulation on one rank: F0 B0 F1 B1 ..."""
    w = _Writer(1, 1, 0, split_backward)
    for mb in range(m):
        w.forward((mb, 0))
        w.backward((mb, 0))
    return w.flush_weight()


def _one_f_one_b(p: int, m: int, rank: int, warmup: int, split_backward: bool) -> list[Step]:
    """Megatron's 1F1B: warm-up forwards, then pairs F(i + warmup) B(i), then cool-down backwards.

    In the steady state the forward output goes out in one batch with the
    receive of the next output gradient, and the input gradient in one batch
    with the receive of the next input, as in Megatron.
    """
    w = _Writer(p, 1, rank, split_backward)
    for i in range(warmup):
        w.comm(recv_forward=(i, 0))
        w.forward((i, 0))
        w.comm(send_forward=(i, 0))
    steady = m - warmup
    if steady:
        w.comm(recv_forward=(warmup, 0))
    for i in range(steady):
        w.forward((warmup + i, 0))
        w.comm(send_forward=(warmup + i, 0), recv_backward=(i, 0))
        w.backward((i, 0))
        w.comm(recv_forward=(warmup + i + 1, 0) if i < steady - 1 else None, send_backward=(i, 0))
    for i in range(steady, m):
        w.comm(recv_backward=(i, 0))
        w.backward((i, 0))
        w.comm(send_backward=(i, 0))
    return w.flush_weight()


def _interleaved_receives(p: int, v: int, rank: int, fwd: list, bwd: list) -> tuple[dict, dict]:
    """Which (microbatch, chunk) the batch after the k-th forward / k-th backward receives.

    Megatron receives the input of the next forward (fwd[k + 1]) after forward
    k, and the output gradient of the next backward after backward k. Between
    neighbours r -> r+1 that keeps the ranks in lockstep: the batch after
    forward k on rank r+1 meets the batch after forward k+1 on rank r. Around
    the ring (rank p-1 -> rank 0) the message is stage (mb, c-1)'s output, sent
    after forward index(mb, c-1) on rank p-1, which lockstep places p-1 batches
    later on rank 0. Megatron receives it only just in time, after forward
    index(mb, c) - 1 = index(mb, c-1) + g - 1, so for g > p rank p-1 would wait
    g - p batches for the receive and, with rendezvous transfers, lock the ring.
    Here rank 0 posts it at index(mb, c-1) + p - 1 (the same batch when g == p)
    and keeps it until its forward; rank p-1 does the mirror image for
    gradients coming around the ring from rank 0.
    """
    recv_forward = {k: fwd[k + 1] for k in range(-1, len(fwd) - 1)}
    recv_backward = {k: bwd[k + 1] for k in range(-1, len(bwd) - 1)}
    if rank == 0:
        index = {unit: k for k, unit in enumerate(fwd)}
        recv_forward = {index[(mb, c - 1)] + p - 1: (mb, c) for mb, c in fwd if c > 0}
    if rank == p - 1:
        index = {unit: k for k, unit in enumerate(bwd)}
        recv_backward = {index[(mb, c + 1)] + p - 1: (mb, c) for mb, c in bwd if c < v - 1}
    return recv_forward, recv_backward


def _interleaved(p: int, v: int, m: int, rank: int, g: int, warmup: int, split_backward: bool) -> list[Step]:
    """Megatron's interleaved 1F1B over the order of `interleaved_order`, with overlapped transfers.

    The k-th forward runs fwd[k], the k-th backward runs bwd[k]. After each
    computation one batch sends its result and receives as
    `_interleaved_receives` says. In the steady state (F, B, F, B, ...) the
    receive for the next forward is thus posted before the backward in between
    and the receive for the next backward before the forward in between: each
    transfer has a whole computation to arrive in (Megatron's overlap_p2p_comm).
    """
    fwd = interleaved_order(m, v, g)
    bwd = [(mb, v - 1 - c) for mb, c in fwd]
    n = len(fwd)
    recv_f, recv_b = _interleaved_receives(p, v, rank, fwd, bwd)
    w = _Writer(p, v, rank, split_backward)
    w.comm(recv_forward=recv_f.get(-1))
    for k in range(warmup):
        w.forward(fwd[k])
        entering_steady = k == warmup - 1 and warmup < n
        w.comm(
            send_forward=fwd[k], recv_forward=recv_f.get(k), recv_backward=recv_b.get(-1) if entering_steady else None
        )
    for k in range(n - warmup):
        f = k + warmup
        w.forward(fwd[f])
        w.comm(send_forward=fwd[f], recv_forward=recv_f.get(f))
        w.backward(bwd[k])
        w.comm(send_backward=bwd[k], recv_backward=recv_b.get(k))
    if warmup == n:
        w.comm(recv_backward=recv_b.get(-1))
    for k in range(n - warmup, n):
        w.backward(bwd[k])
        w.comm(send_backward=bwd[k], recv_backward=recv_b.get(k))
    return w.flush_weight()


def build_schedule(
    p: int,
    v: int,
    m: int,
    rank: int,
    *,
    kind: str = "auto",
    group_size: int | None = None,
    split_backward: bool = False,
) -> list[Step]:
    """The steps pipeline rank `rank` runs for one iteration of m microbatches.

    kind: 'none' (p == 1), '1f1b' (v == 1), 'interleaved' (v > 1, needs
    p <= group_size <= m; group_size defaults to p), 'auto' to pick by p, v, or a zero-bubble
    kind: 'zb-h1' (1F1B with deferred WEIGHT steps), 'interleaved-zb' (the interleaved
    schedule with deferred WEIGHT steps) or 'zbv' (v == 2 in V placement, zbv.py); those split
    every backward whatever `split_backward`.
    `split_backward`: each BACKWARD is followed by its WEIGHT step (see the module docstring).
    Raises ValueError with a one-line message on bad arguments.
    """
    kind, g = _validate(p, v, m, rank, kind, group_size)
    if kind == "zbv":
        return zbv_steps(p, m, rank)
    if kind in DEFERRED:
        base, pending = DEFERRED[kind]
        steps = build_schedule(p, v, m, rank, kind=base, group_size=group_size, split_backward=True)
        return _defer_weights(steps, pending(rank))
    if kind == "none":
        return _no_pipelining(m, split_backward)
    warmup = num_warmup_microbatches(p, v, m, rank, kind=kind, group_size=group_size)
    if kind == "1f1b":
        return _one_f_one_b(p, m, rank, warmup, split_backward)
    return _interleaved(p, v, m, rank, g, warmup, split_backward)


def _defer_weights(steps: list[Step], pending: int) -> list[Step]:
    """Zero-bubble pipelining's deferred weight gradients (Qi et al., 2024) on a split-backward list.

    Each WEIGHT step is postponed while fewer than `pending` others wait: at each WEIGHT slot of
    the split list the oldest waiting one runs instead, and the last `pending` run at the end of
    the iteration, where the rank would otherwise wait for the other ranks. Transfers and the
    order of forwards and backwards are the split list's, so the lists still match up; WEIGHT
    steps of one chunk keep microbatch order, so gradients add up as in 1F1B.

    How many: rank r keeps r pending under 1F1B (ZB-H1) and 2r under the interleaved schedule.
    With them, the simulator gives every rank the idle time (p - 1)(F + B - W) of the zero-bubble
    paper's ZB-H1 (against 1F1B's (p - 1)(F + B + W)); found by searching every count per rank on
    the simulator (p <= 4, v <= 3) and checked for unequal F, B, W (tests/unit/test_schedules.py).
    The later ranks hold more: their backwards arrive first, and their W steps fill the time the
    earlier ranks' cool-down leaves them idle. A pending W step holds its linear layers' inputs and
    output gradients (counted by the memory estimate), not the whole microbatch's activations.
    """
    out: list[Step] = []
    waiting: list[Action] = []
    for step in steps:
        if step[0].kind is not ActionKind.WEIGHT:
            out.append(step)
            continue
        waiting.append(step[0])
        if len(waiting) > pending:
            out.append([waiting.pop(0)])
    return out + [[action] for action in waiting]
