"""Host memory for host-resident chunk state, and the copies between it and the device.

`HostMemory` is one slab per rank from which every host-resident tensor is cut (optimizer
state, gradient and parameter shards: see placement.py), so the host bytes are the slab's,
as the memory estimator counts them. `Transfers` copies on a side stream with an event per
copy on CUDA; where there is no CUDA (host = device) the copies are immediate and there are
no events, so the callers' code path is the same.
"""

from __future__ import annotations

import weakref

import torch


def by_device(tensors: list) -> dict:
    """The tensors grouped by device (host-resident gradient shards sit beside device ones)."""
    groups: dict = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return groups


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
    """One slab of host memory per rank holding every host-resident tensor (fp32 elements;
    parameter shards are cut as whole fp32 elements viewed in the model dtype), handed out in
    slices, so that the host bytes are the slab's, as the memory estimator counts
    (placement.host_elements). With CUDA the slab is allocated as ordinary memory and pinned in place
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
                f"cannot {what} {numel * 4 / 2**30:.2f} GiB of host memory for host-resident chunk state "
                f"({reason}); lower --optimizer-offload-fraction (and --grad-offload-fraction, "
                f"--param-offload-fraction), use --offload-policy auto, or give the process "
                f"more host memory (and a higher locked-memory limit, ulimit -l, for pinned memory)"
            ) from None

    @property
    def nbytes(self) -> int:
        return self.slab.numel() * self.slab.element_size()

    def empty(self, numel: int) -> torch.Tensor:
        if self.used + numel > self.slab.numel():
            raise RuntimeError(
                f"host slab of {self.slab.numel()} elements exhausted (asked {numel} more after {self.used})"
            )
        view = self.slab[self.used : self.used + numel]
        self.used += numel
        return view

    def empty_as(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """`numel` elements of `dtype`, cut as whole fp32 elements."""
        size = torch.empty(0, dtype=dtype).element_size()
        return self.empty(-(-numel * size // 4)).view(dtype)[:numel]

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of `tensor` in its own dtype."""
        out = self.empty_as(tensor.numel(), tensor.dtype)
        out.copy_(tensor.reshape(-1))
        return out

    def zeros(self, numel: int) -> torch.Tensor:
        return self.empty(numel).zero_()


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

    def mark_current(self):
        """An event after the work queued so far on the current stream (None without CUDA)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.stream.device))
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
