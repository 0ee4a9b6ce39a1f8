"""The NCCL communicators one rank's collectives run on, as a function of its layout.

NCCL allocates its own device buffers per communicator (outside torch's caching allocator, so
the trace cannot see them); the estimate adds `Allowances.communicator_bytes` for each group
named here (transients.py). A group counts when it has more than one rank and the trainer runs
a collective on it (megatron/core/parallel_state.py builds them; the users are named per row):

- world: the iteration log's all-reduce (megatron/training/iteration_log.py);
- tp: the tensor-parallel layers' collectives;
- cp: the ring attention's K/V exchange;
- dp x cp: gradient reduction and the distributed optimizer (ModelChunkBuffers); our trainer
  runs nothing on the dp group alone, so it is not counted (Megatron-LM does use it);
- pp: the pipeline's send/recv;
- embedding: first and last stage of a pipeline, for the tied embedding's gradient
  (finalize.py), only on those two stages.

A new group (expert parallel, expert data parallel) is one more row of `_groups`.
"""

from __future__ import annotations


def _groups(par, pp_rank: int, tied: bool) -> dict[str, int]:
    """Every group of the rank, name -> size (1: no peers)."""
    end_stage = pp_rank in (0, par.pp - 1)
    return {
        "world": par.tp * par.cp * par.dp * par.pp,
        "tp": par.tp,
        "cp": par.cp,
        "dp x cp": par.dp * par.cp,
        "pp": par.pp,
        "embedding": 2 if tied and par.pp > 1 and end_stage else 1,
    }


def communicators(config, layout, pp_rank: int) -> tuple[str, ...]:
    """Names of the communicators a rank of pipeline rank `pp_rank` runs collectives on."""
    tied = not config.untie_embeddings_and_output_weights
    return tuple(name for name, size in _groups(layout.parallel, pp_rank, tied).items() if size > 1)
