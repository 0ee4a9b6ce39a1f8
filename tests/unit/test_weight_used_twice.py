"""A linear layer's own weight reports its gradient complete from the layer's backward (autograd gets
none), so a weight used twice per forward would let its bucket's reduction start before the second
gradient lands: the buffers refuse the second report instead."""

import torch

from megatron.core.distributed.model_chunk_buffers import DDPConfig, ModelChunkBuffers
from megatron.core.parallel_state import ParallelDims, ParallelMesh
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.testing.forked_ranks import run_distributed


class _Twice(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(self.layer(x))


def _backward_error(rank: int) -> str | None:
    mesh = ParallelMesh(ParallelDims(), "cpu")
    layer = ColumnParallelLinear(8, 8, tp_group=mesh.tp_group, bias=False, init_std=0.02)
    chunk = ModelChunkBuffers(_Twice(layer), DDPConfig(overlap_grad_reduce=True), mesh.dp_cp_group)
    chunk.zero_grad_buffer()
    chunk.set_is_last_microbatch(True)  # buckets are reduced as backward completes them
    try:
        chunk(torch.randn(4, 1, 8)).sum().backward()
    except RuntimeError as error:
        return str(error)
    return None


def test_a_weight_used_twice_is_refused():
    error = run_distributed(1, _backward_error)[0]
    assert error is not None and "layer.weight: gradient reported complete twice" in error
