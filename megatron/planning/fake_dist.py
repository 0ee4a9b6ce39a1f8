"""Process groups of any size inside one process, for tracing a rank's modules without peers.

Our modules reach their groups only through `torch.distributed`'s functions (sizes, ranks,
collectives, p2p). `fake_collectives()` makes those functions accept `FakeGroup`s for the
duration of a trace: sizes and ranks are the group's, collectives and transfers move no
data (the tensors keep the shapes and dtypes the real call leaves them with: outputs are
allocated by our code, as on a real run). Calls on any other group go to torch unchanged,
so a trace may run inside a real distributed job (the trainer's start-up check).
torch's own fake backend needs `init_process_group`, which a job that already has its
default group cannot call again; this stand-in needs nothing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class FakeGroup:
    size: int
    rank: int = 0


class _DoneWork:
    def wait(self, *args) -> bool:
        return True


@dataclass
class _P2POp:
    op: object
    tensor: object
    peer: int
    group: object = None


def _patched(original, fake):
    def call(*args, **kwargs):
        group = kwargs.get("group", args[-1] if args and isinstance(args[-1], FakeGroup) else None)
        return fake(*args, **kwargs) if isinstance(group, FakeGroup) else original(*args, **kwargs)

    return call


def _batch_isend_irecv(original):
    def call(ops):
        if ops and isinstance(ops[0], _P2POp):
            return [_DoneWork() for _ in ops]
        return original(ops)

    return call


def _p2p_op(op, tensor, peer, group=None, *rest):
    if isinstance(group, FakeGroup):
        return _P2POp(op, tensor, peer, group)
    return dist.distributed_c10d.P2POp(op, tensor, peer, group, *rest)


@contextlib.contextmanager
def fake_collectives():
    """Within: `torch.distributed` functions take `FakeGroup`s (see module docstring)."""
    done = lambda *args, **kwargs: _DoneWork()  # noqa: E731
    replacements = {
        "get_world_size": lambda group=None: group.size,
        "get_rank": lambda group=None: group.rank,
        "get_process_group_ranks": lambda group: list(range(group.size)),
        "all_reduce": done,
        "all_gather_single": done,
        "reduce_scatter_single": done,
        "all_to_all_single": done,
    }
    # torch before 2.13 names the single-tensor collectives all_gather_into_tensor / reduce_scatter_tensor
    # (megatron/core/distributed/collectives.py): patch whichever names this torch has
    replacements |= {"all_gather_into_tensor": done, "reduce_scatter_tensor": done}
    replacements = {name: fake for name, fake in replacements.items() if hasattr(dist, name)}
    saved = {name: getattr(dist, name) for name in (*replacements, "batch_isend_irecv", "P2POp")}
    try:
        for name, fake in replacements.items():
            setattr(dist, name, _patched(saved[name], fake))
        dist.batch_isend_irecv = _batch_isend_irecv(saved["batch_isend_irecv"])
        dist.P2POp = _p2p_op
        yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
