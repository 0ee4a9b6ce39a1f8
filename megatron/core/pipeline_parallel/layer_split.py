"""Which transformer layers each pipeline stage holds: the one mapping every module uses.

Pipeline rank r holds n_r layers: all equal (L / p), or, with Megatron's
`--decoder-first-pipeline-num-layers F` / `--decoder-last-pipeline-num-layers L'`,
F on the first rank, L' on the last and the rest split evenly over the others.
Each rank's layers are split evenly over its v model chunks; global stage
s = c * p + r (chunk c of rank r) holds n_r / v consecutive layers, and the
stages are laid out in order of s, as Megatron does.

In the V placement of `--pipeline-schedule zbv` (placement.py) rank 0 holds both the first stage
(0) and the last (2p-1), so the flags count stages, not ranks: stage 0 holds F layers, stage
2p-1 holds L' and the other 2p-2 stages split the rest evenly; rank r holds stages r and 2p-1-r.
"""

from __future__ import annotations

from megatron.core.pipeline_parallel.placement import Placement


def layers_per_rank(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Layer count of every pipeline rank; raises ValueError (one line) when the split is impossible."""
    if pp == 1:
        if first is not None or last is not None:
            raise ValueError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
        return [num_layers]
    fixed = {0: first, pp - 1: last}
    for flag, value in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    given = {r: n for r, n in fixed.items() if n is not None}
    rest_ranks = pp - len(given)
    rest_layers = num_layers - sum(given.values())
    if rest_layers < rest_ranks or (rest_ranks and rest_layers % rest_ranks) or (not rest_ranks and rest_layers):
        if not given:
            raise ValueError(
                f"--num-layers ({num_layers}) must be divisible by --pipeline-model-parallel-size "
                f"({pp}); or set --decoder-first/last-pipeline-num-layers for an uneven split"
            )
        raise ValueError(
            f"--num-layers ({num_layers}) minus the first/last stage layers ({sum(given.values())}) "
            f"must split evenly over the other {rest_ranks} pipeline ranks, at least one layer each"
        )
    even = rest_layers // rest_ranks if rest_ranks else 0
    return [given.get(r, even) for r in range(pp)]


def _v_stage_counts(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Layers of each of the 2p stages of the V placement (one ValueError line when impossible)."""
    stages = 2 * pp
    given = {s: n for s, n in ((0, first), (stages - 1, last)) if n is not None}
    rest_stages, rest_layers = stages - len(given), num_layers - sum(given.values())
    if rest_layers < rest_stages or rest_layers % rest_stages:
        if not given:
            raise ValueError(
                f"--pipeline-schedule zbv splits --num-layers ({num_layers}) over 2 x "
                f"--pipeline-model-parallel-size = {stages} stages: it must be a multiple of {stages}, "
                "or set --decoder-first/last-pipeline-num-layers for an uneven split"
            )
        raise ValueError(
            f"--pipeline-schedule zbv: --num-layers ({num_layers}) minus the first/last stage layers "
            f"({sum(given.values())}, --decoder-first/last-pipeline-num-layers) must split evenly over the "
            f"other {rest_stages} stages of the V (2 x --pipeline-model-parallel-size - 2), at least one layer each"
        )
    return [given.get(s, rest_layers // rest_stages) for s in range(stages)]


def stage_layer_counts(
    num_layers: int, placement: Placement, first: int | None = None, last: int | None = None
) -> list[int]:
    """Layer count of every global stage, in stage order (one ValueError line when impossible)."""
    for flag, value in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if placement.kind == "v":
        return _v_stage_counts(num_layers, placement.p, first, last)
    counts = layers_per_rank(num_layers, placement.p, first, last)
    for rank, count in enumerate(counts):
        if count % placement.v:
            raise ValueError(
                f"pipeline rank {rank} holds {count} layers, not divisible by {placement.v} virtual "
                "stages per pipeline rank"
            )
    return [counts[placement.location(s)[0]] // placement.v for s in range(placement.num_stages)]


def rank_layer_counts(
    num_layers: int, placement: Placement, first: int | None = None, last: int | None = None
) -> list[int]:
    """Layers held by each pipeline rank, all its chunks together."""
    counts = stage_layer_counts(num_layers, placement, first, last)
    return [sum(counts[placement.stage(r, c)] for c in range(placement.v)) for r in range(placement.p)]


def stage_layer_ids(
    num_layers: int,
    pp: int,
    virtual: int,
    pp_rank: int,
    first: int | None = None,
    last: int | None = None,
    placement: str = "loop",
) -> list[list[int]]:
    """Global layer indices of each local model chunk of `pp_rank` (stages hold consecutive layers
    in stage order)."""
    where = Placement(pp, virtual, placement)
    counts = stage_layer_counts(num_layers, where, first, last)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    stages = [where.stage(pp_rank, c) for c in range(virtual)]
    return [list(range(starts[s], starts[s] + counts[s])) for s in stages]
