"""Finish an iteration's gradients: data-parallel sync, then the tp and embedding reductions.

All of it works on the local shard of each gradient (`ParamAndGradBuffer.local_grads`: the
whole gradient with the replicated optimizer, this rank's shard after the distributed
optimizer's reduce-scatter). The sums below are linear, so reducing shards after the dp
average equals reducing whole gradients before it, provided the ranks that sum hold the
same elements: tp ranks have identical buffer layouts (same shapes in the same order), and
an embedding tied across pipeline stages has a bucket of its own on both stages, padded and
split the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.distributed.host_memory import by_device


def _all_reduce_flat(grads: list, group) -> None:
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def finalize_model_grads(chunks: list, mesh, grad_scale: torch.Tensor | None = None) -> None:
    """`chunks`: this rank's ModelChunkBuffers.

    - wait for the data-parallel (dp x cp) bucket reductions;
    - multiply the local gradients by `grad_scale` (the loss normalisation known only after
      all microbatches ran: token positions / unmasked tokens of the global batch), a tensor
      on the device so that the host never waits for it (the product is in fp32, as with a
      Python float);
    - sum the gradients of replicated weights that saw only a sequence shard
      (`sequence_parallel` norm weights and row-parallel biases) across tp;
    - sum the two copies of tied embeddings across the first and last pipeline stage (on one rank
      when the V placement puts both ends on rank 0).
    """
    for chunk in chunks:
        chunk.finish_grad_sync()
    buffers = [buffer for chunk in chunks for buffer in chunk.buffers]
    if grad_scale is not None:
        shards = [bucket.grad_shard for b in buffers for bucket in b.buckets]
        for where, group in by_device(shards).items():  # host-resident shards take the scale on the host
            torch._foreach_mul_(group, grad_scale.float().to(where))
    _all_reduce_flat(
        [g for b in buffers for g in b.local_grads(lambda p: getattr(p, "sequence_parallel", False))], mesh.tp_group
    )
    holders = [
        shared
        for chunk in chunks
        if (
            shared := [g for b in chunk.buffers for g in b.local_grads(lambda p: getattr(p, "shared_embedding", False))]
        )
    ]
    if len(holders) == 2:  # both copies on this rank (the V placement's rank 0): add them here
        for embedding, output in zip(*holders):
            embedding.add_(output)
            output.copy_(embedding)
    elif holders:
        _all_reduce_flat(holders[0], mesh.embedding_group)
