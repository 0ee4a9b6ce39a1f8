"""Runs a schedule's action list: forward and backward of model chunks, batched p2p transfers.

The executor owns the tensors in flight: inputs received (kept until their
backward, which needs their gradient), outputs (released once posted: only their
autograd graph is kept, the transfer holds the data) and gradients received.
Transfers follow the schedule's semantics (schedules.py): a batch is posted and
not waited for; a computation waits for the receive it consumes, and with it
for every send posted up to that receive's batch (on NCCL that batch and the
ones before it have completed anyway), which bounds the memory held by sends;
whatever is left is waited for at the end of the iteration. It records a
timeline of compute, posting and waiting; time in transfers is this rank's
pipeline idle time.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel.microbatch import Microbatch
from megatron.core.pipeline_parallel.placement import Placement
from megatron.core.pipeline_parallel.schedules import ActionKind, build_schedule, peer_rank


@dataclass
class PipelineSpec:
    """What the executor needs to know about the pipeline of this rank.

    `p2p_shape` is the shape of the activation passed between stages ([s, b, h],
    s divided by tp under sequence parallelism); `group_size` is Megatron's
    microbatch group size per virtual stage (None: p); `every_stage_reads`: the batch
    carries per-sample positions or documents, which every model chunk needs;
    `split_backward`: weight gradients after the input gradient is sent (schedules.py);
    `schedule`: the schedule's kind (schedules.KINDS; the zero-bubble kinds always split).
    """

    p2p_shape: tuple
    p2p_dtype: torch.dtype
    num_microbatches: int
    group_size: int | None = None
    every_stage_reads: bool = False
    split_backward: bool = False
    schedule: str = "auto"


COMPUTE_SPANS = ("forward", "backward", "weight")  # the Span kinds that are computation


class Span(NamedTuple):
    """One piece of a rank's step: `kind` is 'forward', 'backward', 'weight' (the weight
    gradients of a split backward; of `microbatch` on local `chunk`), 'post' (handing a batch
    of transfers to the backend) or 'wait' (blocked on transfers); `start` and `end` are
    seconds since the step began."""

    kind: str
    microbatch: int | None
    chunk: int | None
    start: float
    end: float


@dataclass
class StepStats:
    """What one iteration's schedule produced on this rank.

    The loss is kept as sums, never as per-microbatch means, so the caller can form
    the exact global mean over every unmasked token of the global batch (reduced over
    microbatches, dp and cp): `loss_sum` (sum of masked per-token losses), `tokens`
    (unmasked tokens) and `slots` (all token positions), fp64 tensors on the last
    stage, zero elsewhere. `spans` is the measured timeline of the step (compute,
    posting and waiting), timed with CUDA events on CUDA (host timing would only see
    the enqueue) and read only when asked for, so a step costs no synchronisation;
    time in transfers (posting + waiting) is this rank's pipeline idle time.
    """

    loss_sum: torch.Tensor
    tokens: torch.Tensor
    slots: torch.Tensor
    timer: _SpanTimer | None = None

    @classmethod
    def zeros(cls, device) -> StepStats:
        zero = functools.partial(torch.zeros, (), dtype=torch.float64, device=device)
        return cls(loss_sum=zero(), tokens=zero(), slots=zero())

    def add_loss(self, token_losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """Account one microbatch's masked per-token losses; returns their (differentiable) sum."""
        mask = loss_mask.to(token_losses.dtype)
        loss_sum = (token_losses * mask).sum()
        self.loss_sum += loss_sum.detach().double()
        self.tokens += mask.sum().double()
        self.slots += mask.numel()
        return loss_sum

    def token_sums(self) -> torch.Tensor:
        """[loss sum, unmasked tokens, token positions] (fp64), to add up and reduce."""
        return torch.stack([self.loss_sum, self.tokens, self.slots])

    @functools.cached_property
    def spans(self) -> list[Span]:
        return self.timer.result() if self.timer is not None else []

    def seconds(self, *kinds: str) -> float:
        return sum(span.end - span.start for span in self.spans if span.kind in kinds)

    @property
    def compute_seconds(self) -> float:
        return self.seconds(*COMPUTE_SPANS)

    @property
    def wait_seconds(self) -> float:
        return self.seconds("post", "wait")

    @property
    def idle_fraction(self) -> float:
        total = self.compute_seconds + self.wait_seconds
        return self.wait_seconds / total if total else 0.0


def reduced_token_mean(token_sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce [loss sum, tokens, positions] over the world (only last-stage ranks hold
    non-zero sums; tp ranks' identical copies cancel in the ratios) and return, as fp64 tensors
    on their device (nothing is read by the host), the mean loss over the unmasked tokens and
    positions / tokens: the factor that turns per-position gradients into gradients of that
    mean. Nothing unmasked gives loss 0 and factor 1, not NaN."""
    dist.all_reduce(token_sums)
    loss_sum, tokens, slots = token_sums.unbind()
    none = tokens == 0
    return torch.where(none, 0.0, loss_sum / tokens), torch.where(none, 1.0, slots / tokens)


def global_token_mean(token_sums: torch.Tensor) -> tuple[float, float]:
    """`reduced_token_mean`, read by the host."""
    loss, grad_scale = reduced_token_mean(token_sums)
    return loss.item(), grad_scale.item()


class _SpanTimer:
    """Records the spans of one step: host clock on CPU, CUDA events on CUDA (read when the
    spans are asked for, so timing adds no synchronisation to the step). On CUDA a span
    is what the device stream saw: a wait is the time the compute stream stalled."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.origin = self._now()
        self.spans: list[tuple] = []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self):
        return self._now()

    def stop(self, kind: str, started, action=None) -> None:
        self.spans.append((kind, action, started, self._now()))

    def _seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a

    def result(self) -> list[Span]:
        if self.cuda and self.spans:
            self.spans[-1][3].synchronize()  # the last event recorded: every earlier one has completed
        return [
            Span(
                kind,
                getattr(action, "microbatch", None),
                getattr(action, "chunk", None),
                self._seconds(self.origin, start),
                self._seconds(self.origin, end),
            )
            for kind, action, start, end in self.spans
        ]


def _run_backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Backward from a loss (grad None) or from an output whose storage was released
    after sending (its shape no longer matches its gradient: bypass autograd's check)."""
    if grad is None:
        output.backward()
        return
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _release(tensor: torch.Tensor) -> None:
    """Free an output's activation memory once sent; its grad_fn stays for backward."""
    tensor.data = torch.empty((1,), device=tensor.device, dtype=tensor.dtype)


class PipelineExecutor:
    """Executes one iteration of the schedule for this rank.

    `chunks[c]` is local model chunk c (a ModelChunkBuffers module), called
    as chunk(inputs, **model_inputs) -> hidden states, or on the last stage
    chunk(inputs, labels, loss_mask=..., **model_inputs) -> per-token loss (the mask: the loss's
    weights, which the fused LM head + cross-entropy needs in its forward). `batch(mb)`
    returns the Microbatch mb (or its first three fields: input ids, labels, loss mask).
    """

    def __init__(self, chunks: list, mesh, spec: PipelineSpec):
        self.chunks, self.mesh, self.spec = chunks, mesh, spec
        self.p, self.v, self.rank = mesh.pp_size, len(chunks), mesh.pp_rank
        self.placement = Placement.for_schedule(self.p, self.v, spec.schedule)
        self.steps = build_schedule(
            self.p,
            self.v,
            spec.num_microbatches,
            self.rank,
            kind=spec.schedule,
            group_size=spec.group_size,
            split_backward=spec.split_backward,
        )
        self.split = any(a.kind is ActionKind.WEIGHT for step in self.steps for a in step)
        self.last_backward = self._last_backward_index()
        # per local chunk, looked up by every compute step (local_*: the chunk of the neighbouring
        # stage when it is on this rank, else None)
        self.holds_first_stage = [self.placement.is_first(self.rank, c) for c in range(self.v)]
        self.holds_last_stage = [self.placement.is_last(self.rank, c) for c in range(self.v)]
        self.local_previous = [self._local_neighbour(c, -1) for c in range(self.v)]
        self.local_following = [self._local_neighbour(c, +1) for c in range(self.v)]

    def _last_backward_index(self) -> dict:
        """Microbatch of each chunk's final backward: the data-parallel reduction of that
        chunk's gradients starts during it (or during its WEIGHT step, with a split backward)."""
        last = {}
        for step in self.steps:
            for action in step:
                if action.kind is ActionKind.BACKWARD:
                    last[action.chunk] = action.microbatch
        return last

    def _local_neighbour(self, chunk: int, offset: int) -> int | None:
        """The local chunk of the stage `offset` away, when it runs on this rank (the V's turn)."""
        if not self.placement.is_local(self.rank, chunk, offset):
            return None
        return self.placement.neighbour(self.rank, chunk, offset)[1]

    def run(self, batch, loss_scale: float = 1.0, zero_grads: bool = False) -> StepStats:
        """One iteration. Each microbatch's backward starts from its masked loss sum times
        loss_scale / (m x token positions): the mean when nothing is masked; the caller
        rescales the reduced gradients by (positions / unmasked tokens) of the global batch.
        `zero_grads`: zero each chunk's gradient buffer just before its first backward, so the
        forwards before it need not wait for what still reads the old gradients."""
        device = next(self.chunks[0].parameters()).device
        stats, timer = StepStats.zeros(device), _SpanTimer(device)
        inputs, outputs, received_grads, input_grads = {}, {}, {}, {}
        unzeroed = set(range(self.v)) if zero_grads else set()
        transfers = _Transfers()
        for step in self.steps:
            action = step[0]
            key = (action.microbatch, action.chunk)
            if action.kind is ActionKind.FORWARD:
                previous = self.local_previous[action.chunk]
                if previous is not None:  # the previous stage's output, handed over on this rank
                    inputs[key] = outputs[(action.microbatch, previous)].detach().requires_grad_()
                elif not self.holds_first_stage[action.chunk]:
                    self._wait(transfers, ActionKind.RECV_FORWARD, key, timer)
                started = timer.start()
                outputs[key] = self._forward(action, inputs, batch, stats, loss_scale / self.spec.num_microbatches)
                timer.stop("forward", started, action)
            elif action.kind is ActionKind.BACKWARD:
                following = self.local_following[action.chunk]
                if following is not None:  # the next stage's input gradient, handed over on this rank
                    received_grads[key] = input_grads.pop((action.microbatch, following))
                elif not self.holds_last_stage[action.chunk]:
                    self._wait(transfers, ActionKind.RECV_BACKWARD, key, timer)
                started = timer.start()
                if action.chunk in unzeroed:
                    unzeroed.discard(action.chunk)
                    self.chunks[action.chunk].zero_grad_buffer()
                self._backward(action, inputs, outputs, received_grads, input_grads)
                inputs.pop(key, None), outputs.pop(key, None)
                timer.stop("backward", started, action)
            elif action.kind is ActionKind.WEIGHT:
                started = timer.start()
                chunk = self.chunks[action.chunk]
                chunk.set_is_last_microbatch(self.last_backward[action.chunk] == action.microbatch)
                chunk.compute_weight_grads(action.microbatch)
                timer.stop("weight", started, action)
            else:
                started = timer.start()
                self._post(step, transfers, inputs, outputs, received_grads, input_grads, device)
                timer.stop("post", started)
        started = timer.start()
        transfers.wait_all()
        timer.stop("wait", started)
        stats.timer = timer
        return stats

    @staticmethod
    def _wait(transfers: _Transfers, kind: ActionKind, key: tuple, timer: _SpanTimer) -> None:
        started = timer.start()
        transfers.wait(kind, key)
        timer.stop("wait", started)

    def _forward(self, action, inputs, batch, stats, scale):
        key = (action.microbatch, action.chunk)
        first, last = self.holds_first_stage[action.chunk], self.holds_last_stage[action.chunk]
        # the first and last stage read data (input ids, labels); every stage reads per-sample positions
        data = Microbatch(*batch(action.microbatch)) if first or last or self.spec.every_stage_reads else None
        model_inputs = data.model_inputs() if data is not None else {}
        chunk_input = data.tokens if first else inputs[key]
        chunk = self.chunks[action.chunk]
        if not last:
            return chunk(chunk_input, **model_inputs)
        token_losses = chunk(chunk_input, data.labels, loss_mask=data.loss_mask, **model_inputs)
        return stats.add_loss(token_losses, data.loss_mask) * (scale / data.loss_mask.numel())

    def _backward(self, action, inputs, outputs, received_grads, input_grads):
        key = (action.microbatch, action.chunk)
        chunk = self.chunks[action.chunk]
        chunk.set_is_last_microbatch(self.last_backward[action.chunk] == action.microbatch)
        output = outputs[key]
        grad = None if self.holds_last_stage[action.chunk] else received_grads.pop(key)
        with chunk.deferring_weight_grads(action.microbatch) if self.split else contextlib.nullcontext():
            _run_backward(output, grad)
        if not self.holds_first_stage[action.chunk]:
            input_grads[key] = inputs[key].grad

    def _post(self, step, transfers, inputs, outputs, received_grads, input_grads, device):
        """Post one step's transfers as one batch on the pipeline group (peers are global ranks within it),
        its sends first. The order within a batch is free (gloo matches each direction's messages
        in posting order, NCCL runs the batch as one group); on gloo a receive posted before the
        send of the same batch cost its transport threads ~15% more CPU time per step (1F1B, p = 4:
        docs/pipeline.md "1F1B against torch"), as in torch's schedules, which post sends first."""
        ops, group = [], self.mesh.pp_group
        step = sorted(step, key=_is_receive)
        for action in step:
            key = (action.microbatch, action.chunk)
            kind = action.kind
            peer = self.mesh.pp_peer(peer_rank(action, self.rank, self.placement) - self.rank)
            if kind is ActionKind.SEND_FORWARD:
                ops.append(dist.P2POp(dist.isend, outputs[key].detach(), peer, group))
            elif kind is ActionKind.SEND_BACKWARD:
                ops.append(dist.P2POp(dist.isend, input_grads.pop(key), peer, group))
            elif kind is ActionKind.RECV_FORWARD:
                buffer = torch.empty(self.spec.p2p_shape, dtype=self.spec.p2p_dtype, device=device, requires_grad=True)
                inputs[key] = buffer
                ops.append(dist.P2POp(dist.irecv, buffer.data, peer, group))
            else:
                buffer = torch.empty(self.spec.p2p_shape, dtype=self.spec.p2p_dtype, device=device)
                received_grads[key] = buffer
                ops.append(dist.P2POp(dist.irecv, buffer, peer, group))
        transfers.post(step, dist.batch_isend_irecv(ops))
        for action in step:
            if action.kind is ActionKind.SEND_FORWARD:  # the posted send holds the data until it completes
                _release(outputs[(action.microbatch, action.chunk)])


def _is_receive(action) -> bool:
    return action.kind in (ActionKind.RECV_FORWARD, ActionKind.RECV_BACKWARD)


class _Transfers:
    """The requests of the batches posted in this iteration and not yet waited for.

    gloo returns one request per op; NCCL coalesces a batch into one request (or a
    few), which then stands for every op of the batch."""

    def __init__(self):
        self.batches = 0
        self.receives: dict[tuple, tuple[int, list]] = {}  # (kind, mb, chunk) -> (batch index, requests)
        self.sends: list[tuple[int, object]] = []  # (batch index, request)

    def post(self, step, requests: list) -> None:
        per_op = [[r] for r in requests] if len(requests) == len(step) else [requests] * len(step)
        for action, mine in zip(step, per_op):
            if action.kind in (ActionKind.RECV_FORWARD, ActionKind.RECV_BACKWARD):
                self.receives[(action.kind, action.microbatch, action.chunk)] = (self.batches, mine)
            else:
                self.sends += [(self.batches, r) for r in mine]
        self.batches += 1

    def wait(self, kind: ActionKind, key: tuple) -> None:
        """Wait for one receive and for the sends posted up to its batch."""
        batch, requests = self.receives.pop((kind, *key))
        for request in requests:
            request.wait()
        for _, request in (earlier := [s for s in self.sends if s[0] <= batch]):
            request.wait()
        self.sends = self.sends[len(earlier) :]

    def wait_all(self) -> None:
        for _, requests in self.receives.values():
            for request in requests:
                request.wait()
        for _, request in self.sends:
            request.wait()
        self.receives, self.sends = {}, []
