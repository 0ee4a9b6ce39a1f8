"""The offload optimizer's memory: device and host bytes of a rank, and the fraction that fits.

Exact to megatron/core/optimizer/offload.py: an element of the distributed optimizer's shard
kept on the device costs its optimizer state there (Adam's m and v, 8 bytes, plus a 4-byte
fp32 master unless the weights are fp32); an offloaded element costs nothing on the device
and 16 bytes on host: fp32 master (a copy even of fp32 weights, which stay on the device as
the model), m, v and the host copy of its gradient (whose bytes are reused as the staging of
the updated weights in the model dtype). Weights and gradient buffers never move.
Which elements go to host is decided per memory chunk (offload_policy.static_offloaded), so a
split differs from the flag's fraction by up to half a chunk; `offloaded_chunks` makes the
optimizer's own call on the estimator's BufferLayouts, and `chunk_fraction` is the fraction
that call realises, which `offload_bytes` then reproduces to the byte.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron.core.optimizer.offload_policy import forward_order, static_offloaded

HOST_BYTES_PER_ELEMENT = 16  # fp32 master, exp_avg, exp_avg_sq, gradient copy


@dataclass(frozen=True)
class OffloadBytes:
    device_bytes: int  # optimizer state left on the device
    host_bytes: int


def offloaded_chunks(buffers: list, fraction: float) -> frozenset:
    """Indices of this rank's shards (one per bucket, in build_shards' order) that the static
    policy puts on host for `fraction`: the call MixedPrecisionOptimizer makes, on `buffers`
    (the BufferLayouts of the rank's chunks)."""
    numels = [bucket.shard_numel for b in buffers for bucket in b.buckets]
    return static_offloaded(forward_order(buffers), numels, fraction)


def chunk_fraction(buffers: list, fraction: float) -> float:
    """The share of the rank's optimizer elements on host once `fraction` is rounded to whole chunks."""
    numels = [bucket.shard_numel for b in buffers for bucket in b.buckets]
    total = sum(numels)
    return sum(numels[i] for i in offloaded_chunks(buffers, fraction)) / total if total else 0.0


def offload_bytes(shard_elements: int, device_bytes_per_element: int, fraction: float) -> OffloadBytes:
    """`shard_elements`: this rank's optimizer elements (its 1/(dp cp) of the padded buffers);
    `device_bytes_per_element`: 8 (fp32 weights) or 12 (bf16/fp16) when kept on the device."""
    host = round(fraction * shard_elements)
    return OffloadBytes((shard_elements - host) * device_bytes_per_element, host * HOST_BYTES_PER_ELEMENT)


def fraction_that_fits(certain_bytes: int, optimizer_bytes: int, device_bytes: int) -> float | None:
    """The smallest offload fraction under which a rank's certain part (weights, gradients,
    optimizer state, saved activations; optimizer state counted on the device) fits
    `device_bytes`: 0 when it already fits, None when even full offload does not. The planner
    passes the full estimate and its threshold's share of the device instead; either way the
    fraction is before rounding to whole chunks (`chunk_fraction`)."""
    excess = certain_bytes - device_bytes
    if excess <= 0:
        return 0.0
    if optimizer_bytes <= 0 or excess > optimizer_bytes:
        return None
    return excess / optimizer_bytes

