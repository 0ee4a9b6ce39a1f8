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
On a machine without CUDA the same path runs with host = device: the copies are plain copies
and the worker shares the cores with the training thread.
"""
from __future__ import annotations

import functools
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from megatron.core.optimizer.cpu_adam import CpuAdamW, default_cpu_threads


class HostMemoryError(RuntimeError):
    """Host buffers for offloaded state could not be allocated (one line naming what to change)."""


def _pin_in_place(slab: torch.Tensor) -> None:
    """Page-lock `slab` where it is (cudaHostRegister) and unlock it when its memory is freed."""
    cudart = torch.cuda.cudart()
    pointer, nbytes = slab.data_ptr(), slab.numel() * slab.element_size()
    error = cudart.cudaHostRegister(pointer, nbytes, 0)
    if int(error) != 0:
        raise RuntimeError(cudart.cudaGetErrorString(error))
    weakref.finalize(slab.untyped_storage(), cudart.cudaHostUnregister, pointer)


class HostMemory:
    """One slab of host memory per rank holding every offloaded tensor (all fp32), handed out
    in slices, so that the host bytes are the slab's: 16 per offloaded element, as the memory
    estimator counts. With CUDA the slab is allocated as ordinary memory and pinned in place
    (page-locked memory is what lets copies run asynchronously on a side stream): torch's
    pinned allocator would round every block up to a power of two, up to twice the bytes."""

    def __init__(self, numel: int, pin: bool):
        self.pin = pin
        self.used = 0
        what = "pin" if pin else "allocate"
        try:
            self.slab = torch.empty(numel, dtype=torch.float32)
            if pin and numel:
                _pin_in_place(self.slab)
        except RuntimeError as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise HostMemoryError(
                f"cannot {what} {numel * 4 / 2**30:.2f} GiB of host memory for the offloaded optimizer "
                f"({reason}); lower --optimizer-offload-fraction, use --offload-policy auto, or give the process "
                f"more host memory (and a higher locked-memory limit, ulimit -l, for pinned memory)") from None

    @property
    def nbytes(self) -> int:
        return self.slab.numel() * self.slab.element_size()

    def empty(self, numel: int) -> torch.Tensor:
        if self.used + numel > self.slab.numel():
            raise RuntimeError(f"host slab of {self.slab.numel()} elements exhausted (asked {numel} more "
                             f"after {self.used})")
        view = self.slab[self.used: self.used + numel]
        self.used += numel
        return view

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        out = self.empty(tensor.numel())
        out.copy_(tensor)
        return out

    def zeros(self, numel: int) -> torch.Tensor:
        return self.empty(numel).zero_()


HOST_TENSORS_PER_ELEMENT = 4  # fp32 master, exp_avg, exp_avg_sq and the gradient's host copy


class Transfers:
    """Device <-> host copies on a side stream with an event each (CUDA); elsewhere immediate
    copies and no events, so the caller's code path is the same."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        if self.stream is None:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def side_waits_for_current(self) -> None:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))

    @staticmethod
    def current_waits(event) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    @staticmethod
    def synchronize(event) -> None:
        if event is not None:
            event.synchronize()


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

    def __init__(self, adam, order: list[int], device: torch.device, threads: int | None = None,
                 buffer_of: list | None = None):
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
        self.stats = OffloadStats()

    def _cpu_adam(self, index: int) -> CpuAdamW:
        shard = self.adam.shards[index]
        return CpuAdamW(shard.main, shard.host_grad, self.adam.exp_avg[index], self.adam.exp_avg_sq[index],
                        shard.decay, shard.decoupled)

    def _staging(self, index: int) -> torch.Tensor:
        """The updated weights in the model dtype, on host: the master itself when that is fp32,
        else the first half of the gradient copy's bytes (free once the step has read them)."""
        shard = self.adam.shards[index]
        if shard.model.dtype == torch.float32:
            return shard.main
        return shard.host_grad.view(shard.model.dtype)[: shard.model.numel()]

    def start(self) -> None:
        """Stream the (final) gradient shards to host and queue each chunk's CPU step."""
        adam = self.adam
        hyper = _Hyper(adam.step_count, adam.lr, adam.decoupled_lr, adam.betas, adam.eps, adam.weight_decay)
        self.transfers.side_waits_for_current()  # the gradients are final on the training stream
        arrived = {i: self.transfers.copy(adam.shards[i].host_grad, adam.shards[i].grad) for i in self.order}
        for i in self.order:
            if arrived[i] is not None and self.buffer_of is not None:  # zeroing the gradient waits for its copy
                self.buffer_of[i].reuse_waits.append(functools.partial(self.transfers.current_waits, arrived[i]))
            self.stats.d2h_bytes += adam.shards[i].grad.numel() * adam.shards[i].grad.element_size()
            self.pending[i] = self.pool.submit(self._step, i, arrived[i], hyper)
        self.stats.steps += 1

    def _step(self, index: int, arrived, hyper: _Hyper):
        self.transfers.synchronize(arrived)
        begin = time.perf_counter()
        self.cpu[index].step(hyper.step, hyper.lr, hyper.decoupled_lr, hyper.betas, hyper.eps, hyper.weight_decay)
        shard, staging = self.adam.shards[index], self._staging(index)
        if staging is not shard.main:
            staging.copy_(shard.main)
        seconds = time.perf_counter() - begin
        return self.transfers.copy(shard.model, staging), seconds

    def wait(self, index: int) -> None:
        """Block until chunk `index` is stepped; the training stream then waits for its weights."""
        future = self.pending.pop(index, None)
        if future is None:
            return
        begin = time.perf_counter()
        copied, seconds = future.result()
        self.stats.exposed_seconds += time.perf_counter() - begin
        self.stats.cpu_seconds += seconds
        shard = self.adam.shards[index]
        self.stats.h2d_bytes += shard.model.numel() * shard.model.element_size()
        self.transfers.current_waits(copied)

    def wait_all(self) -> None:
        for index in list(self.pending):
            self.wait(index)

    def take_stats(self) -> OffloadStats:
        stats, self.stats = self.stats, OffloadStats()
        return stats

    def keep_on_device(self, indices) -> None:
        """Bring the state of shards `indices` back to the device (the auto policy, after
        measuring) and move the rest into a slab of their own size, so that the host holds
        only what stays offloaded."""
        self.wait_all()
        adam = self.adam
        for index in indices:
            shard = adam.shards[index]
            device = shard.model.device
            shard.main = shard.model if shard.model.dtype == torch.float32 else shard.main.to(device)
            adam.exp_avg[index] = adam.exp_avg[index].to(device)
            adam.exp_avg_sq[index] = adam.exp_avg_sq[index].to(device)
            shard.host_grad = None
            self.order.remove(index)
            del self.cpu[index]
        host = HostMemory(HOST_TENSORS_PER_ELEMENT * sum(adam.shards[i].main.numel() for i in self.order),
                          adam.host_memory.pin)
        for index in self.order:
            shard = adam.shards[index]
            shard.main, shard.host_grad = host.copy_of(shard.main), host.copy_of(shard.host_grad)
            adam.exp_avg[index], adam.exp_avg_sq[index] = host.copy_of(adam.exp_avg[index]), host.copy_of(
                adam.exp_avg_sq[index])
            self.cpu[index] = self._cpu_adam(index)
        adam.host_memory = host


def _worker_with_threads(threads: int) -> ThreadPoolExecutor:
    """One worker thread whose intra-op parallelism is `threads`. torch's setting is per thread
    once a thread has used it, but threads that start later take the last value set; so the
    worker sets its own and the caller's is set again afterwards (unchanged for the caller,
    and again the default for threads started later, such as the batch loader's)."""
    training = torch.get_num_threads()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-adam", initializer=torch.set_num_threads,
                              initargs=(threads,))
    pool.submit(torch.get_num_threads).result()  # the worker exists and has taken its setting
    torch.set_num_threads(training)
    return pool
