"""The ZB-V zero-bubble schedule (Qi et al., ICLR 2024, section 6) as action lists.

Two model chunks per rank in V placement (placement.py): rank r holds stage r (chunk 0) and
stage 2p-1-r (chunk 1). Every backward is split into BACKWARD (input gradient) and WEIGHT
(weight gradients). The compute order of rank r, with n = max(m, 2p - 1) microbatches
(microbatches m and above are dropped at the end, as torch.distributed.pipelining's
`ScheduleZBVZeroBubble` does; its order is the reference):

* warm-up: 2(p-r)-1 forwards of chunk 0; then r times a forward of chunk 1 and one of chunk 0;
  then p-r times a forward of chunk 1 followed by its backward and weight step;
* steady state, while forwards are left: a forward of chunk 0 (if any is left), the backward
  and weight step of chunk 0, a forward of chunk 1, the backward and weight step of chunk 1;
* cool-down: r times a backward of chunk 0 and one of chunk 1 (weight steps held back); p-r
  times a backward of chunk 0 and the oldest held-back weight step of chunk 0; then the held
  weight steps of chunk 1, then those of chunk 0.

With equal F, B and W times the ranks run in lockstep a unit apart and the only idle time is
the fill of the V's first half and the drain of its last. Weight steps of a chunk stay in
microbatch order, so gradients add up as in 1F1B. Activation memory peaks at 2p microbatch-chunks of
L/(2p) layers on every rank: what 1F1B's rank 0 holds (p microbatches of L/p layers), on every rank.

Transfers: after each computation one batch sends its result (unless it is the last stage's
loss, the first stage's input gradient, or the local hand-off from stage p-1 to stage p on rank
p-1, which the executor passes directly) and posts the receives of what the neighbours send in
the same slot of that lockstep (`_receive_slots`). Any number of microbatches runs (below 2p - 1
the V is not filled and the bubble grows); `tests/unit/test_zbv_schedule.py` checks on
the simulator that the lists match up and cannot deadlock.
"""

from __future__ import annotations

from megatron.core.pipeline_parallel.actions import Action, ActionKind, Step
from megatron.core.pipeline_parallel.placement import Placement

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT


def zbv_compute_order(p: int, m: int, rank: int) -> list[Action]:
    """Rank `rank`'s computations, in order."""
    return [action for _, action in _slotted_order(p, m, rank)]


def _slotted_order(p: int, m: int, rank: int) -> list[tuple[int, Action]]:
    """(slot, computation) of rank `rank`: with F = B = W = 1 unit every computation takes one
    slot and rank r starts r slots late, so a message sent at the end of slot t is consumed at a
    later slot on its neighbour (the tests check it)."""
    n = max(m, 2 * p - 1)
    order: list[Action] = []
    count = dict.fromkeys(((kind, chunk) for kind in (F, B, W) for chunk in (0, 1)), 0)

    def run(kind: ActionKind, chunk: int) -> None:
        order.append(Action(kind, count[(kind, chunk)], chunk))
        count[(kind, chunk)] += 1

    for _ in range(2 * (p - rank) - 1):
        run(F, 0)
    for _ in range(rank):
        run(F, 1), run(F, 0)
    for _ in range(p - rank):
        run(F, 1), run(B, 1), run(W, 1)
    while count[(F, 1)] < count[(F, 0)] or count[(F, 0)] < n:
        if count[(F, 0)] < n:
            run(F, 0)
        run(B, 0), run(W, 0), run(F, 1), run(B, 1), run(W, 1)
    for _ in range(rank):
        run(B, 0), run(B, 1)
    for _ in range(p - rank):
        run(B, 0), run(W, 0)
    for chunk in (1, 0):
        while count[(W, chunk)] < count[(B, chunk)]:
            run(W, chunk)
    return [(rank + k, action) for k, action in enumerate(order) if action.microbatch < m]


def zbv_steps(p: int, m: int, rank: int) -> list[Step]:
    """The steps of rank `rank`: each computation, then one batch with its send and the receives
    of the messages its neighbours send in the same slot (`_receive_slots`)."""
    placement = Placement(p, 2, "v")
    timed = _slotted_order(p, m, rank)
    receives = _receive_slots(placement, m, rank)
    steps: list[Step] = []
    for k in range(len(timed) + 1):
        ops = []
        if k > 0:
            steps.append([timed[k - 1][1]])
            send = _transfer(placement, rank, timed[k - 1][1], receive=False)
            ops += [send] if send is not None else []
        until = timed[k][0] if k < len(timed) else None  # receives of messages sent before this slot
        while receives and (until is None or receives[0][0] < until):
            ops.append(receives.pop(0)[1])
        if ops:
            steps.append(ops)
    return steps


def _transfer(placement: Placement, rank: int, action: Action, receive: bool) -> Action | None:
    """The receive `action` consumes (`receive`) or the send of its result, if another rank is on
    the other end: a forward sends to the next stage, a backward receives from it."""
    if action.kind is W:
        return None
    towards_next = (action.kind is F) != receive
    if (placement.is_last if towards_next else placement.is_first)(rank, action.chunk):
        return None
    if placement.is_local(rank, action.chunk, +1 if towards_next else -1):
        return None
    return Action(_TRANSFER_KIND[(action.kind, receive)], action.microbatch, action.chunk)


def _receive_slots(placement: Placement, m: int, rank: int) -> list[tuple[int, Action]]:
    """(slot of the send, receive) of every message rank `rank` receives, in slot order.

    Each receive is posted in the batch after the receiver's computation of the slot its message
    is sent in (or the last one before it), so the batches of a slot meet those of the same slot
    on the neighbours and complete together: no rank's send waits for a receive that a later
    batch of its peer would post, which under NCCL (a rank's batches complete in order) would
    deadlock; a neighbour does not send in the order this rank consumes (at p = 4 rank 2 sends
    rank 3 the input of microbatch 4 before the gradient of microbatch 0, which rank 3 needs
    first), and posting in send order keeps the messages of each pair of ranks matched."""
    receives = []
    for neighbour in (rank - 1, rank + 1):
        if not 0 <= neighbour < placement.p:
            continue
        for slot, action in _slotted_order(placement.p, m, neighbour):
            send = _transfer(placement, neighbour, action, receive=False)
            if send is None:
                continue
            to_next = send.kind is ActionKind.SEND_FORWARD
            peer, chunk = placement.neighbour(neighbour, send.chunk, +1 if to_next else -1)
            if peer == rank:
                kind = ActionKind.RECV_FORWARD if to_next else ActionKind.RECV_BACKWARD
                receives.append((slot, Action(kind, send.microbatch, chunk)))
    return sorted(receives, key=lambda item: item[0])


_TRANSFER_KIND = {
    (F, False): ActionKind.SEND_FORWARD,
    (F, True): ActionKind.RECV_FORWARD,
    (B, False): ActionKind.SEND_BACKWARD,
    (B, True): ActionKind.RECV_BACKWARD,
}
