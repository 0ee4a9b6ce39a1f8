"""torch before 2.13 (the CUDA images ship 2.11) names the single-tensor collectives
all_gather_into_tensor / reduce_scatter_tensor: our collectives and the memory estimate's fake
collectives work under either name (the estimate failed on torch 2.11 before)."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import collectives
from megatron.core.distributed.model_chunk_buffers import DDPConfig
from megatron.core.parallel_config import ParallelConfig
from megatron.core.transformer.config import TransformerConfig
from megatron.planning import MemoryLayout, estimate_memory
from tests.distributed import run_distributed

TINY = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32)


@pytest.fixture
def old_torch_names(monkeypatch):
    monkeypatch.delattr(dist, "all_gather_single")
    monkeypatch.delattr(dist, "reduce_scatter_single")


def test_estimate_under_old_names(old_torch_names):
    layout = MemoryLayout(ParallelConfig(dp=2, ddp=DDPConfig(use_distributed_optimizer=True)))
    assert estimate_memory(TINY, layout).ranks[0].parameters > 0


def _gather_and_scatter(rank, world=2):
    del dist.all_gather_single, dist.reduce_scatter_single  # this spawned process only
    x = torch.full((2,), float(rank + 1))
    gathered = torch.empty(2 * world)
    collectives.all_gather_single(gathered, x)
    scattered = torch.empty(2)
    collectives.reduce_scatter_single(scattered, torch.arange(2.0 * world))
    return gathered.tolist(), scattered.tolist()


def test_collectives_under_old_names():
    results = run_distributed(2, _gather_and_scatter)
    assert [r[0] for r in results] == [[1.0, 1.0, 2.0, 2.0]] * 2
    assert [r[1] for r in results] == [[0.0, 2.0], [4.0, 6.0]]
