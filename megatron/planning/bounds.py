"""What the planner knows of a layout before it traces anything: a lower bound on the certain part.

The pipeline rank holding the most parameters holds at least 1/pp of a tensor-parallel rank's
parameters, and a tensor-parallel rank at least 1/tp of the model's parameters outside experts
(split tensors' shards, replicated ones whole; a tied embedding's second copy only adds) and
1/(ep etp) of its experts'. Each of its parameters costs its weight, its gradient-buffer element
and its optimizer state (over dp x cp with the distributed optimizer, experts' over edp), before
any bucket padding: model_states.py's bytes are at least these.
A layout whose bound exceeds device memory has a certain part that does too: fit_rule's "does
not fit", decided without a trace.
"""

from __future__ import annotations

from megatron.core.distributed.placement import part_bytes
from megatron.planning.kernels import dtype_bytes
from megatron.planning.parameters import expert_parameters, total_parameters


def certain_lower_bound(config, layout) -> int:
    """Bytes of model states on the fullest pipeline rank, at least; 0 where the bound does not
    apply (sharded gradients or parameters, offload: their shards and host parts move bytes)."""
    par, ddp = layout.parallel, layout.parallel.ddp
    if ddp.sharding_strategy not in ("no_shard", "optim") or layout.offload.enabled:
        return 0
    state = dtype_bytes(config.params_dtype) + ddp.grad_dtype.itemsize
    optimizer = part_bytes(dtype_bytes(config.params_dtype), False, False).optimizer
    sharded = ddp.use_distributed_optimizer
    experts = expert_parameters(config) if config.num_moe_experts is not None else 0
    dense = (total_parameters(config, par.tp) - experts) / (par.tp * par.pp)
    dense_bytes = dense * (state + optimizer / (par.dp * par.cp if sharded else 1))
    expert_bytes = experts / (par.ep * par.dims.etp * par.pp) * (state + optimizer / (par.dims.edp if sharded else 1))
    return int(dense_bytes + expert_bytes)
