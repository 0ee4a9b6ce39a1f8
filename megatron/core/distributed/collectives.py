"""torch.distributed's single-tensor collectives under whichever name the installed torch has.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` and deprecated the old names; GPU users bring their own torch, and the
CUDA images seen so far ship 2.11, which has only the old names. The name is looked up at each
call, not at import, so whatever patches `torch.distributed` (the memory estimate's fake
collectives in planning/fake_dist.py, the tests' collective counters) still sees the call.
"""

from __future__ import annotations

import torch.distributed as dist


def all_gather_single(output, tensor, group=None, async_op=False):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


def reduce_scatter_single(output, tensor, group=None, async_op=False):
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, tensor, group=group, async_op=async_op)
