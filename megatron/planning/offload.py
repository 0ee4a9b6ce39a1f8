"""Host-resident chunks in the estimate: where a rank's weights, gradients and optimizer state live.

Exact to the runtime because it makes the runtime's own calls (megatron/core/distributed/placement.py)
on the estimator's BufferLayouts: the static placement of each part's fraction, taken in whole
chunks from the end of the forward order (so a split differs from a flag's fraction by up to
half a chunk), then each part's bytes where it lives:
- optimizer state: 8 bytes per element on the device (Adam's moments) plus a 4-byte fp32 master
  unless the weights are fp32; on host 16 (fp32 master even of fp32 weights, m, v and the
  gradient's host copy, whose bytes are reused to stage the updated weights);
- gradient shard (sharded gradients): its fp32 bytes on the device, or on host where it is its
  own host copy (nothing more), plus two staging slots of the largest host-resident shard for
  the additions of each microbatch's gradient;
- parameter shard (sharded parameters): its model-dtype bytes on the device or on host;
  whole buffers (strategies that do not shard a part) stay on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.distributed.placement import chunk_placement, host_elements, part_bytes, shard_numels


@dataclass(frozen=True)
class StateBytes:
    weights: int
    grads: int
    optimizer: int
    host: int


def _on_device(numels: list[int], on_host: frozenset) -> int:
    return sum(n for i, n in enumerate(numels) if i not in on_host)


def state_bytes(buffers: list, layout, weight_bytes: int) -> StateBytes:
    """Device bytes of weights, gradients and optimizer state, and the host slab's bytes."""
    numels = shard_numels(buffers)
    placement = chunk_placement(buffers, *layout.offload_fractions)
    padded = sum(b.numel for b in buffers)
    optimizer = _on_device(numels, placement.optimizer) * part_bytes(weight_bytes, False, False).optimizer
    ddp = layout.parallel.ddp
    weights = (_on_device(numels, placement.params) if ddp.shards_params else padded) * weight_bytes
    grads = (_on_device(numels, placement.grads) if ddp.shards_grads else padded) * ddp.grad_dtype.itemsize
    return StateBytes(weights, grads, optimizer, 4 * host_elements(numels, placement, weight_bytes))


def fraction_that_fits(certain_bytes: int, optimizer_bytes: int, device_bytes: int) -> float | None:
    """The smallest offload fraction under which a rank's certain part (weights, gradients,
    optimizer state, saved activations; optimizer state counted on the device) fits
    `device_bytes`: 0 when it already fits, None when even full offload does not. The planner
    passes the full estimate instead (fit_rule's "fits"); either way the fraction is before
    rounding to whole chunks (`chunk_placement`)."""
    excess = certain_bytes - device_bytes
    if excess <= 0:
        return 0.0
    if optimizer_bytes <= 0 or excess > optimizer_bytes:
        return None
    return excess / optimizer_bytes
