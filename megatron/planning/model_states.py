"""Weights, gradients and optimizer state of one rank, exact to our buffers and optimizer.

Every model chunk keeps its parameters and their fp32 gradients (`main_grad`) in two
flat buffers laid out by `BufferLayout` (megatron/core/distributed/bucket_layout.py), and
its experts' in two more (the expert buffer, sharded over the expert-data-parallel group
instead of dp x cp), and the optimizer (megatron/core/optimizer/) keeps one flat fp32 shard
per bucket. The estimate builds the same `BufferLayout`s from the parameter shapes, so:

- weights and gradients: the buffers' elements, padding included, in `params_dtype`
  and in the gradient dtype; `param.grad` exists only inside backward (the
  post-accumulate hook adds it to `main_grad` and drops it), so it is a transient;
- optimizer (`ShardedAdamW`): per shard, Adam m and v in fp32 (8 bytes per element),
  plus an fp32 master copy (4 bytes) when the weights are bf16 or fp16 (fp32 weights
  are their own master). The step count is one Python integer: no per-tensor state;
- a shard is a whole bucket with the replicated optimizer (no padding), and 1/(dp cp)
  of a bucket padded to a multiple of dp x cp x SHARD_ALIGN elements with the
  distributed optimizer: 6 + 12/d bytes per parameter for bf16 weights, plus padding
  (experts: 1/edp, edp = tp cp dp / (ep etp) the ranks holding the same expert shards);
- offload and host-resident chunks (`--optimizer-cpu-offload` and the gradient / parameter
  fractions, offload.py): the parts the static policy puts on host cost nothing on the device
  and their bytes in `host_bytes`; offloaded shards are stepped on the CPU, so the device
  step's temporaries come from the other shards only;
- sharded gradients (optim_grads) keep only the fp32 shard of each bucket between steps; a
  bucket's unsharded gradient exists while backward fills it and its reduce-scatter runs.
  Sharded parameters (optim_grads_params) keep only the shard of the weights too; a bucket's
  whole weights exist while gathered. Those whole buckets are `gathered_bytes`, alive during
  forward and backward only: without pipelining at most UNSHARDED_BUCKETS of the largest
  bucket of each buffer kind, dense and expert, whose hooks run apart (filled/used, being
  reduced or prefetched, the next), plus one held through the pass
  where the tied embedding and output layer share a chunk (with --unsharded-grad-accumulation
  every bucket's whole gradient, from the first backward to the last); under pipeline parallelism (unless
  --reshard-params-after-forward) every bucket's weights stay gathered from the first forward
  to the last backward of the step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megatron.core.distributed.bucket_layout import SHARD_ALIGN, BufferLayout, default_bucket_size
from megatron.core.distributed.placement import chunk_placement, shard_numels
from megatron.planning.kernels import dtype_bytes
from megatron.planning.offload import state_bytes
from megatron.planning.parameters import chunk_shapes, numel, shared_embedding_index

STEP_TEMPORARIES = 2  # fp32 shard-sized tensors alive at once in ShardedAdamW.step
UNSHARDED_BUCKETS = 3  # whole buckets of one kind alive at once under optim_grads(_params), see above


@dataclass(frozen=True)
class ModelStates:
    parameters: int
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    host_bytes: int
    gathered_bytes: int = 0  # whole buckets alive during forward/backward only (sharded grads/params)

    @property
    def device_bytes(self) -> int:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.gathered_bytes


def chunk_buffers(config, layout, chunk) -> list[BufferLayout]:
    """The bucket layouts of `chunk`'s buffers, as ModelChunkBuffers builds them (its `buffers`: the
    dense one, then the experts' if the chunk has MoE layers): parameters in reverse order (the order
    backward produces their gradients), the embedding tied across stages in a bucket of its own,
    sharded over dp x cp (experts: over edp) with the distributed optimizer."""
    par = layout.parallel
    dense = tuple(numel(s) for s in chunk_shapes(config, par.tp, chunk))
    experts = tuple(numel(s) for s in chunk_shapes(config, par.tp, chunk, expert=True))
    buffers = [(dense, shared_embedding_index(config, layout, chunk), par.dp * par.cp)]
    buffers += [(experts, None, par.dims.edp)] if experts else []
    return [
        _buffer_layout(
            numels,
            shared,
            par.ddp.bucket_size or default_bucket_size(replicas),
            replicas if par.ddp.use_distributed_optimizer else 1,
        )
        for numels, shared, replicas in buffers
    ]


@functools.lru_cache(maxsize=4096)
def _buffer_layout(numels: tuple[int, ...], shared: int | None, bucket_size: int, shards: int) -> BufferLayout:
    """Cached: the planner asks for the same chunks under many layouts."""
    params = [(str(i), n, i == shared) for i, n in enumerate(numels)]
    return BufferLayout(list(reversed(params)), bucket_size, shards, SHARD_ALIGN)


def model_states(config, layout, chunks: list[list[BufferLayout]]) -> ModelStates:
    """`chunks`: each model chunk's `chunk_buffers`."""
    buffers = [b for buffers in chunks for b in buffers]
    states = state_bytes(buffers, layout, dtype_bytes(config.params_dtype))
    return ModelStates(
        parameters=sum(p.numel for b in buffers for p in b.params),
        weights_bytes=states.weights,
        grads_bytes=states.grads,
        optimizer_bytes=states.optimizer,
        host_bytes=states.host,
        gathered_bytes=gathered_bytes(config, layout, chunks),
    )


def gathered_bytes(config, layout, chunks: list[list[BufferLayout]]) -> int:
    """Whole buckets besides the persistent shards, at the peak of forward/backward (see above);
    `chunks`: each model chunk's `chunk_buffers`."""
    ddp = layout.parallel.ddp
    if not ddp.shards_grads:
        return 0
    dense, experts = [c[0] for c in chunks], [b for c in chunks for b in c[1:]]
    held = int(not config.untie_embeddings_and_output_weights and layout.parallel.stages == 1)

    def whole(buffers: list[BufferLayout], held: int) -> int:
        """Elements of the whole buckets of one kind alive at once."""
        return (UNSHARDED_BUCKETS + held) * max((bucket.numel for b in buffers for bucket in b.buckets), default=0)

    every = sum(b.numel for buffers in chunks for b in buffers)
    grads = every if ddp.unsharded_grad_accumulation else whole(dense, held) + whole(experts, 0)
    if not ddp.shards_params:
        return grads * ddp.grad_dtype.itemsize
    params = whole(dense, held) + whole(experts, 0) if ddp.reshard_after_forward else every
    return grads * ddp.grad_dtype.itemsize + params * dtype_bytes(config.params_dtype)


def optimizer_step_temporary(buffers: list[BufferLayout], offload_fraction: float = 0.0) -> int:
    """Largest temporary allocation of `MixedPrecisionOptimizer.step`.

    `ShardedAdamW.step` works shard by shard, on every device: `exp_avg_sq.sqrt()` and
    its quotient by the bias correction (the denominator) are alive together, as are
    the denominator and `exp_avg / denom` with --decoupled-lr: two fp32 tensors of the
    largest shard. Gradient preparation (unscale, inf check, norm, clipping) works in
    place or on scalars, and the parameter sync copies in place. Offloaded shards step on the CPU.
    """
    host = chunk_placement(buffers, offload_fraction).optimizer
    largest = max((n for i, n in enumerate(shard_numels(buffers)) if i not in host), default=0)
    return STEP_TEMPORARIES * 4 * largest
