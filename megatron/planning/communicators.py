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
  (finalize.py), only on those two stages;
- MoE (`_moe_groups`): tp x cp, the load-balancing loss's route counts (router.py, and its logged
  value, aux_losses.py) on every rank; on a rank with MoE layers, ep and etp (the alltoall
  dispatcher's all-to-all and uneven gather), ep x etp (the alltoall dispatcher's count gather, the
  allgather dispatcher's gathers), edp (the expert buffer's gradients and optimizer shards) and the
  stage's tp x dp x cp (the expert-bias counts).

A new group is one more row of `_groups`.
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
        # the V placement (zbv) holds both copies on rank 0 and adds them there: no group
        "embedding": 2 if tied and par.pp > 1 and end_stage and par.placement.kind == "loop" else 1,
    }


def _moe_groups(config, par, moe_layers: bool) -> dict[str, int]:
    """The MoE groups of a rank (module docstring), name -> size (1: none)."""
    if config.num_moe_experts is None:
        return {}
    ep, etp = config.expert_model_parallel_size, config.expert_tensor_parallel_size
    balancing = config.moe_aux_loss_coeff > 0 and config.moe_router_load_balancing_type != "none"
    alltoall = moe_layers and config.moe_token_dispatcher_type == "alltoall"
    return {
        "tp x cp": par.tp * par.cp if balancing else 1,
        "ep": ep if alltoall else 1,
        "etp": etp if alltoall else 1,
        "ep x etp": ep * etp if moe_layers else 1,
        "edp": par.dims.edp if moe_layers else 1,
        "tp x dp x cp": par.tp * par.dp * par.cp if moe_layers and config.moe_router_enable_expert_bias else 1,
    }


def communicators(config, layout, pp_rank: int, moe_layers: bool = False) -> tuple[str, ...]:
    """Names of the communicators a rank of pipeline rank `pp_rank` runs collectives on; `moe_layers`:
    whether its model chunks hold MoE layers."""
    tied = not config.untie_embeddings_and_output_weights
    groups = _groups(layout.parallel, pp_rank, tied) | _moe_groups(config, layout.parallel, moe_layers)
    return tuple(name for name, size in groups.items() if size > 1)
