"""Finish an iteration's gradients: data-parallel sync, then the tp and embedding reductions."""
from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce_flat(grads: list, group) -> None:
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def finalize_model_grads(chunks: list, mesh, grad_scale: float = 1.0) -> None:
    """`chunks`: this rank's DistributedDataParallel model chunks.

    - wait for the data-parallel (dp x cp) bucket reductions;
    - multiply every gradient by `grad_scale` (the loss normalisation known only after
      all microbatches ran: token positions / unmasked tokens of the global batch);
    - sum the gradients of replicated weights that saw only a sequence shard
      (`sequence_parallel` norm weights and row-parallel biases) across tp;
    - sum the two copies of tied embeddings across the first and last pipeline stage.
    """
    for chunk in chunks:
        chunk.finish_grad_sync()
    params = [p for chunk in chunks for p in chunk.module.parameters()]
    if grad_scale != 1.0:
        torch._foreach_mul_([p.main_grad for p in params], grad_scale)
    _all_reduce_flat([p.main_grad for p in params if getattr(p, "sequence_parallel", False)], mesh.tp_group)
    shared = [p.main_grad for p in params if getattr(p, "shared_embedding", False)]
    if shared:
        _all_reduce_flat(shared, mesh.embedding_group)
