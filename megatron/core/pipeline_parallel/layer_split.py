"""Which transformer layers each pipeline stage holds: the one mapping every module uses.

Pipeline rank r holds n_r layers: all equal (L / p), or, with Megatron's
`--decoder-first-pipeline-num-layers F` / `--decoder-last-pipeline-num-layers L'`,
F on the first rank, L' on the last and the rest split evenly over the others.
Each rank's layers are split evenly over its v model chunks; global stage
s = c * p + r (chunk c of rank r) holds n_r / v consecutive layers, and the
stages are laid out in order of s, as Megatron does.
"""

from __future__ import annotations


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


def stage_layer_ids(
    num_layers: int, pp: int, virtual: int, pp_rank: int, first: int | None = None, last: int | None = None
) -> list[list[int]]:
    """Global layer indices of each local model chunk of `pp_rank`."""
    counts = layers_per_rank(num_layers, pp, first, last)
    for rank, count in enumerate(counts):
        if count % virtual:
            raise ValueError(
                f"pipeline rank {rank} holds {count} layers, not divisible by {virtual} virtual "
                "stages per pipeline rank"
            )
    per_chunk = [count // virtual for count in counts]
    starts, offset = {}, 0
    for c in range(virtual):
        for rank in range(pp):
            starts[(c, rank)] = offset
            offset += per_chunk[rank]
    return [list(range(starts[(c, pp_rank)], starts[(c, pp_rank)] + per_chunk[pp_rank])) for c in range(virtual)]
