"""The offload optimizer and host-resident chunks wait for every copy they read, as CUDA needs.

On CPU, `Transfers` copies at once, so a read that does not wait for its copy goes unseen there
and races on a GPU. Here the copies are emulated as asynchronous: a copy lands only when its
event is waited for (`current_waits` / `synchronize`), and reads its source either when it is
queued or when it lands (the two ends of what a side stream may do). The losses of 3
iterations at DP2 (fp32, and the offload optimizer in bf16) then still equal the same layout's
run with immediate copies exactly: no reader goes before its copy, and no writer changes a
copy's source before it lands.
"""

from __future__ import annotations

import contextlib

import pytest

from megatron.core.distributed.host_memory import Transfers
from tests.distributed import run_distributed
from tests.parallel.layouts import train

OFFLOAD = ["--use-distributed-optimizer", "--optimizer-cpu-offload"]
HOST_RESIDENT = [
    *("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--optimizer-cpu-offload"),
    *("--grad-offload-fraction", "1", "--param-offload-fraction", "1"),
]
# bf16: the updated weights are staged in the bytes of the gradient's host copy
LAYOUTS = {
    "optimizer offload": OFFLOAD,
    "optimizer offload, bf16": [*OFFLOAD, "--bf16"],
    "host resident": HOST_RESIDENT,
}


@contextlib.contextmanager
def asynchronous_copies(read_source_when: str):
    """Transfers whose copies land when waited for; `read_source_when`: "queued" or "landing"."""
    pending: dict = {}

    class Copy:  # stands in for the CUDA event a copy returns
        pass

    def copy(self, dst, src):
        event = Copy()
        pending[event] = (dst, src.clone() if read_source_when == "queued" else src)
        return event

    def land(event):
        if event in pending:
            dst, src = pending.pop(event)
            dst.copy_(src)

    patched = {"copy": copy, "current_waits": staticmethod(land), "synchronize": staticmethod(land)}
    saved = {name: Transfers.__dict__[name] for name in patched}
    for name, fn in patched.items():
        setattr(Transfers, name, fn)
    try:
        yield pending
    finally:
        for name, fn in saved.items():
            setattr(Transfers, name, fn)


def _losses(rank, flags):
    out = {"immediate": train("llama", flags, iterations=3)["losses"]}
    for when in ("queued", "landing"):
        with asynchronous_copies(when) as pending:
            out[when] = train("llama", flags, iterations=3)["losses"]
        out[f"{when} never landed"] = len(pending)
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_copies_are_waited_for(name):
    for rank, out in enumerate(run_distributed(2, _losses, LAYOUTS[name])):
        for when in ("queued", "landing"):
            assert out[when] == out["immediate"], f"rank {rank}, source read when {when}: {out[when]}"
