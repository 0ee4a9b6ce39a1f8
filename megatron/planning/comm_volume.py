"""Bytes each rank sends per collective of a training step, and the bandwidth its group gets.

Volumes are what one rank sends (ring algorithms: an all-gather or a reduce-scatter of
a tensor of S bytes over n ranks sends (n - 1) / n x S; an all-reduce twice that).
The mesh orders ranks pp, dp, cp, tp (tp fastest), so a group is `size` ranks
`stride` apart: tp (stride 1), cp (stride tp), dp x cp for gradients (stride tp),
pipeline neighbours (stride tp cp dp).
"""

from __future__ import annotations

from megatron.planning.hardware import Hardware


def ring_share(n: int) -> float:
    """What one rank sends in an all-gather or reduce-scatter over n ranks, per byte of the full tensor."""
    return (n - 1) / n


def tp_bytes_per_layer(tokens: int, hidden: int, element_bytes: int, tp: int) -> float:
    """One layer, one pass (forward or backward): two all-gathers and two reduce-scatters of the
    [tokens, hidden] activation under sequence parallelism, or two all-reduces without (the same bytes)."""
    return 0.0 if tp == 1 else 4 * ring_share(tp) * tokens * hidden * element_bytes


def cp_bytes_per_layer(tokens: int, kv_width: int, element_bytes: int, cp: int) -> float:
    """One layer's forward: the ring passes this rank's K and V ([tokens, kv_width] each, tokens per
    cp rank) on cp - 1 times. The backward passes K, V and their gradients: twice this."""
    return 0.0 if cp == 1 else (cp - 1) * 2 * tokens * kv_width * element_bytes


def p2p_bytes(tokens: int, hidden: int, element_bytes: int, tp: int, sequence_parallel: bool) -> float:
    """One pipeline send: the [tokens, hidden] activation (or its gradient), split over tp under SP."""
    return tokens * hidden * element_bytes / (tp if sequence_parallel else 1)


def dp_bytes(
    parameters: float,
    ranks: int,
    grad_bytes: int,
    param_bytes: int,
    distributed: bool,
    reductions: int = 1,
    gathers: int = 1,
) -> tuple[float, float]:
    """(gradient reduction, parameter all-gather) bytes sent per rank per step over dp x cp `ranks`:
    `reductions` reduce-scatters of the gradients and `gathers` all-gathers of the parameters with
    the distributed optimizer (sharding strategies: step_time.dp_collectives); an all-reduce of
    the gradients (and nothing to gather) without."""
    if ranks == 1:
        return 0.0, 0.0
    if distributed:
        return (
            reductions * ring_share(ranks) * parameters * grad_bytes,
            gathers * ring_share(ranks) * parameters * param_bytes,
        )
    return 2 * ring_share(ranks) * parameters * grad_bytes, 0.0


def group_bandwidth(hw: Hardware, size: int, stride: int) -> float:
    """Bytes/s one rank of a ring over `size` ranks `stride` apart sends at, by the links' figures.

    Inside a node: NVLink. Across nodes each GPU has its own network adapter and NCCL runs one
    ring per adapter, so a group with k ranks on each node moves k adapters' worth of bytes
    between nodes (capped by NVLink): a dp group of 8 ranks per node reaches 8 x 25 GB/s on
    A100 nodes, one of 1 rank per node (tp = 8) 25 GB/s."""
    if size <= 1:
        return float("inf")
    if size * stride <= hw.gpus_per_node:
        return hw.intra_node_gbps * 1e9
    per_node = max(1, min(size, hw.gpus_per_node // stride))
    return min(hw.intra_node_gbps, hw.inter_node_gbps * per_node) * 1e9
