"""The offload optimizer: the middle part (state and step) of chosen shards in host memory.

After PatrickStar and ZeRO-Offload, without their limits: an offloaded shard keeps its fp32
master weights and Adam moments in host memory (one slab per rank, pinned when CUDA is present,
allocated once) and is stepped by the CPU on a worker thread with its own thread budget, every
other part of the optimizer unchanged: gradient preparation (fp16 unscale and inf check, the
global norm, clipping) runs on the device gradients of every shard, so clipping is by the exact
global norm, gradient accumulation and the loss scaler work as without offload, and a skipped
step never reaches the host.

Why the CPU step starts after the norm, not during backward: clipping scales every gradient by
a factor known only when the last gradient exists, and Adam is not linear in its gradient, so
stepping a chunk before the norm is known means stepping optimistically and rolling back
(another 8 bytes per element of host memory, and the step wasted whenever clipping is active,
which it is for most of early training), or stepping on last iteration's gradients (a delayed
update: different numerics). We defer instead and hide the CPU work behind the *next forward*:

1. `start()` (after the norm is known): the gradient shards stream device -> host on a side
   stream, in the order the next forward needs the chunks; a worker thread steps each chunk as
   soon as its gradient has arrived (torch's fused CPU AdamW, `cpu_adam.py`), writes the
   updated weights in the model dtype into host staging (the gradient copy's own bytes: no
   fp32 copy ever goes to the device) and streams them host -> device. Chunk i's CPU step
   overlaps chunk i+1's device -> host and chunk i-1's host -> device copy. The training
   stream does not wait for the device -> host copies: a model chunk's gradient buffer waits
   for its own copies only when it is next zeroed, before that chunk's first backward of the
   next iteration (ParamAndGradBuffer.reuse_waits).
2. `wait(i)` (a forward pre-hook, `param_sync.ParamSync`): the first module of the next forward
   that uses chunk i waits for it, then its parameters are all-gathered. Chunks of the first
   layers step first, so the forward starts as soon as they are done while the CPU steps the
   rest.
Host-resident chunks (distributed/placement.py) change two things: a chunk whose gradient
shard lives on host has no copy to make in 1. (the step reads the shard in place, and zeroing
it waits for the step), and one whose parameter shard lives on host gets the updated weights
written straight into that shard (copied to the device only when its bucket is gathered).
On a machine without CUDA the same path runs with host = device: the copies are plain copies
and the worker shares the cores with the training thread.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from megatron.core.distributed.host_memory import Transfers
from megatron.core.optimizer.cpu_adam import CpuAdamW, default_cpu_threads


@dataclass
class OffloadStats:
    """Since the last `reset`: bytes moved each way, seconds the CPU spent stepping, and seconds
    the training thread was blocked waiting for a chunk (the part of the CPU step not hidden)."""

    d2h_bytes: int = 0
    h2d_bytes: int = 0
    cpu_seconds: float = 0.0
    exposed_seconds: float = 0.0
    steps: int = 0

    @property
    def hidden_fraction(self) -> float:
        if self.cpu_seconds <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.exposed_seconds / self.cpu_seconds))


@dataclass(frozen=True)
class _Hyper:
    """The step's hyperparameters, copied when it starts: the training thread may already set
    the next iteration's learning rate while the worker steps."""

    step: int
    lr: float
    decoupled_lr: float | None
    betas: tuple[float, float]
    eps: float
    weight_decay: float


class OffloadedSteps:
    """Steps the offloaded shards of `adam` (an adamw.ShardedAdamW) on the CPU, chunk by chunk
    in `order` (shard indices in the order the next forward uses them)."""

    def __init__(
        self, adam, order: list[int], device: torch.device, threads: int | None = None, buffer_of: list | None = None
    ):
        """`threads`: the CPU step's intra-op threads (None: default_cpu_threads() with CUDA, else
        the training thread's); the training thread's own setting is left as it is. `buffer_of[i]`:
        the ParamAndGradBuffer holding shard i's gradient (whose zeroing waits for its copy)."""
        if threads is None:
            threads = default_cpu_threads() if device.type == "cuda" else torch.get_num_threads()
        self.threads = threads
        self.adam = adam
        self.order = [i for i in order if adam.shards[i].offloaded]
        self.buffer_of = buffer_of
        self.transfers = Transfers(device)
        self.cpu = {i: self._cpu_adam(i) for i in self.order}
        self.pool = _worker_with_threads(threads)
        self.pending: dict = {}
        self.landed: dict = {}  # host-resident gradients: the copy of the weights out of their bytes
        self.stats = OffloadStats()

    def _cpu_adam(self, index: int) -> CpuAdamW:
        shard = self.adam.shards[index]
        return CpuAdamW(
            shard.main,
            shard.host_grad,
            self.adam.exp_avg[index],
            self.adam.exp_avg_sq[index],
            shard.decay,
            shard.decoupled,
        )

    def _staging(self, index: int) -> torch.Tensor:
        """The updated weights in the model dtype, on host: the parameter shard itself when it is
        host-resident, the master when the weights are fp32, else the first half of the gradient
        copy's bytes (free once the step has read them)."""
        shard = self.adam.shards[index]
        if shard.model_on_host:
            return shard.model
        if shard.model.dtype == torch.float32:
            return shard.main
        return shard.host_grad.view(shard.model.dtype)[: shard.model.numel()]

    def start(self) -> None:
        """Stream the (final) gradient shards to host and queue each chunk's CPU step."""
        adam = self.adam
        hyper = _Hyper(adam.step_count, adam.lr, adam.decoupled_lr, adam.betas, adam.eps, adam.weight_decay)
        self.transfers.side_waits_for_current()  # the gradients are final on the training stream
        moving = [i for i in self.order if not adam.shards[i].grad_on_host]  # resident ones are read in place
        arrived = {i: self.transfers.copy(adam.shards[i].host_grad, adam.shards[i].grad) for i in moving}
        # a resident chunk's step writes host memory that copies queued so far may still read
        # (host-resident parameters fetched by the last backward): it waits for them instead
        queued = self.transfers.mark_current() if len(arrived) < len(self.order) else None
        for i in self.order:
            if self.buffer_of is not None and i not in arrived:  # zeroing the gradient waits for the step
                self.buffer_of[i].reuse_waits.append(functools.partial(self._landed, i))
            elif arrived[i] is not None and self.buffer_of is not None:  # zeroing the gradient waits for its copy
                self.buffer_of[i].reuse_waits.append(functools.partial(self.transfers.current_waits, arrived[i]))
            if i in arrived:
                self.stats.d2h_bytes += adam.shards[i].grad.numel() * adam.shards[i].grad.element_size()
            self.pending[i] = self.pool.submit(self._step, i, arrived.get(i, queued), hyper)
        self.stats.steps += 1

    def _step(self, index: int, arrived, hyper: _Hyper):
        self.transfers.synchronize(arrived)
        begin = time.perf_counter()
        self.cpu[index].step(hyper.step, hyper.lr, hyper.decoupled_lr, hyper.betas, hyper.eps, hyper.weight_decay)
        shard, staging = self.adam.shards[index], self._staging(index)
        if staging is not shard.main:
            staging.copy_(shard.main)
        seconds = time.perf_counter() - begin
        if staging is shard.model:  # host-resident parameters: fetched when their bucket is gathered
            return None, seconds, 0
        return self.transfers.copy(shard.model, staging), seconds, staging.numel() * staging.element_size()

    def wait(self, index: int) -> None:
        """Block until chunk `index` is stepped; the training stream then waits for its weights."""
        future = self.pending.pop(index, None)
        if future is None:
            return
        begin = time.perf_counter()
        copied, seconds, moved = future.result()
        self.stats.exposed_seconds += time.perf_counter() - begin
        self.stats.cpu_seconds += seconds
        self.stats.h2d_bytes += moved
        self.transfers.current_waits(copied)
        if self.adam.shards[index].grad_on_host:
            self.landed[index] = copied

    def _landed(self, index: int) -> None:
        """A host-resident gradient may be zeroed: its step has read it and the weights staged in
        its bytes have reached the device."""
        self.wait(index)
        Transfers.synchronize(self.landed.pop(index, None))

    def wait_all(self) -> None:
        for index in list(self.pending):
            self.wait(index)

    def take_stats(self) -> OffloadStats:
        stats, self.stats = self.stats, OffloadStats()
        return stats


def placement_bytes(adam) -> tuple[int, int]:
    """(device, host) bytes of optimizer state: on the device counted from the tensors that exist
    (master copies, not fp32 weights that are their own master, and moments); on host the slab
    that holds the offloaded masters, moments and gradient copies (what the process holds)."""
    device = 0
    for shard, exp_avg, exp_avg_sq in zip(adam.shards, adam.exp_avg, adam.exp_avg_sq):
        if not shard.offloaded:
            tensors = [exp_avg, exp_avg_sq] + ([] if shard.aliased else [shard.main])
            device += sum(t.numel() * t.element_size() for t in tensors)
    return device, adam.host_memory.nbytes if adam.host_memory is not None else 0


def _worker_with_threads(threads: int) -> ThreadPoolExecutor:
    """One worker thread whose intra-op parallelism is `threads`. torch's setting is per thread
    once a thread has used it, but threads that start later take the last value set; so the
    worker sets its own and the caller's is set again afterwards (unchanged for the caller,
    and again the default for threads started later, such as the batch loader's)."""
    training = torch.get_num_threads()
    pool = ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="cpu-adam", initializer=torch.set_num_threads, initargs=(threads,)
    )
    pool.submit(torch.get_num_threads).result()  # the worker exists and has taken its setting
    torch.set_num_threads(training)
    return pool
