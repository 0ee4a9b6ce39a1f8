"""Weights, gradients and optimizer state of one rank, exact to our DDP and optimizer code.

- weights: the parameters in `params_dtype`;
- gradients: the DDP buffer (`main_grad`, fp32 by default) holds one element per
  parameter (megatron/core/distributed/grad_buffer.py); `param.grad` exists only
  transiently inside backward (the post-accumulate hook adds it to `main_grad` and
  drops it), so it is a transient, not a state;
- optimizer (megatron/core/optimizer/optimizer.py, torch AdamW): Adam m and v in
  fp32 (8 bytes), plus an fp32 master copy (4 bytes) when the weights are bf16 or
  fp16 (fp32 weights are their own master), plus AdamW's `step` counter, a
  4-byte tensor per parameter tensor. The counters live on the parameters'
  device only when that is the CPU (non-capturable AdamW keeps them on the host
  for CUDA parameters), so they count only on CPU.
- distributed optimizer (not built in the trainer; estimate only): master, m and v
  are sharded over the dp x cp ranks: ceil(N / (dp cp)) elements each, giving
  the familiar 6 + 12/d bytes per parameter for bf16 weights and fp32 gradients.
- offload (not built): `layout.offload_optimizer_fraction` of the optimizer bytes
  moves to `host_bytes`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.core.memory.kernels import dtype_bytes
from megatron.core.memory.parameters import Shape, numel

ADAM_MOMENTS_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4        # fp32 master copy of bf16/fp16 weights
STEP_COUNTER_BYTES = 4  # AdamW's per-tensor `step`, an fp32 scalar tensor


@dataclass(frozen=True)
class ModelStates:
    parameters: int
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    host_bytes: int

    @property
    def device_bytes(self) -> int:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes


def optimizer_bytes_per_parameter(config) -> int:
    """fp32 master (unless the weights are fp32) + Adam m and v."""
    master = 0 if dtype_bytes(config.params_dtype) == 4 else MASTER_BYTES
    return master + ADAM_MOMENTS_BYTES


def model_states(config, layout, shapes: list[Shape]) -> ModelStates:
    n = sum(numel(s) for s in shapes)
    per_param = optimizer_bytes_per_parameter(config)
    if layout.distributed_optimizer:
        optimizer = per_param * math.ceil(n / (layout.dp * layout.cp))
    else:
        optimizer = per_param * n
        if layout.device_type == "cpu":
            optimizer += STEP_COUNTER_BYTES * len(shapes)
    host = int(optimizer * layout.offload_optimizer_fraction)
    return ModelStates(parameters=n, weights_bytes=n * dtype_bytes(config.params_dtype),
                       grads_bytes=n * layout.grad_dtype_bytes, optimizer_bytes=optimizer - host, host_bytes=host)


def optimizer_step_temporary(config, layout, shapes: list[Shape]) -> int:
    """Largest temporary allocation of `MixedPrecisionOptimizer.step`.

    torch AdamW picks its implementation by device: the foreach path (CUDA)
    allocates sqrt(v) for a whole parameter group at once (fp32, the weight-decay
    group of >= 2-D tensors is the larger); the single-tensor path (CPU) allocates
    sqrt(v) and sqrt(v) / bias_correction for one tensor at a time. With fp16 the
    inf check adds a bool tensor per parameter (smaller than either).
    """
    if not shapes:
        return 0
    if layout.distributed_optimizer:
        shard = math.ceil(sum(numel(s) for s in shapes) / (layout.dp * layout.cp))
        return 4 * shard
    if layout.device_type == "cuda":
        decay = sum(numel(s) for s in shapes if len(s) >= 2)
        no_decay = sum(numel(s) for s in shapes if len(s) < 2)
        return 4 * max(decay, no_decay)
    return 2 * 4 * max(numel(s) for s in shapes)
