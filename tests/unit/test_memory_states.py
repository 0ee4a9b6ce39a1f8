"""Weights, gradients and optimizer bytes per parameter, exact to our DDP buffer and optimizer."""
import dataclasses

import pytest
import torch

from megatron.core.memory import MemoryLayout
from megatron.core.memory.model_states import model_states, optimizer_step_temporary
from megatron.core.memory.parameters import numel
from megatron.core.transformer.config import TransformerConfig

CONFIG = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=32)
SHAPES = [(256, 64), (64,), (1024, 64), (64, 256)]
N = sum(numel(s) for s in SHAPES)


def states(dtype, **layout):
    return model_states(dataclasses.replace(CONFIG, params_dtype=dtype), MemoryLayout(**layout), SHAPES)


def test_fp32_weights_are_their_own_master():
    """fp32: 4 (weights) + 4 (fp32 main_grad) + 8 (Adam m, v); no master copy."""
    s = states(torch.float32)
    assert (s.weights_bytes, s.grads_bytes, s.optimizer_bytes) == (4 * N, 4 * N, 8 * N)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_weights_have_fp32_master(dtype):
    """bf16/fp16: 2 + 4 (fp32 main_grad) + 12 (fp32 master + m + v) = 18 bytes per parameter."""
    s = states(dtype)
    assert (s.weights_bytes, s.grads_bytes, s.optimizer_bytes) == (2 * N, 4 * N, 12 * N)


def test_adam_step_counters_count_on_cpu_only():
    """AdamW keeps a 4-byte `step` tensor per parameter tensor on the parameters' device only on CPU."""
    cpu = states(torch.float32, device_type="cpu")
    assert cpu.optimizer_bytes == 8 * N + 4 * len(SHAPES)


@pytest.mark.parametrize("d", [1, 2, 4, 8, 64])
def test_distributed_optimizer_is_6_plus_12_over_d(d):
    s = states(torch.bfloat16, dp=d, distributed_optimizer=True)
    assert N % d == 0
    assert s.device_bytes / N == pytest.approx(6 + 12 / d, rel=0, abs=1e-12)


def test_distributed_optimizer_shards_over_dp_times_cp():
    s = states(torch.bfloat16, dp=2, cp=2, distributed_optimizer=True)
    assert s.optimizer_bytes == 12 * N // 4


def test_offload_moves_optimizer_to_host():
    s = states(torch.bfloat16, offload_optimizer_fraction=1.0)
    assert (s.optimizer_bytes, s.host_bytes) == (0, 12 * N)
    assert states(torch.bfloat16).host_bytes == 0


def test_optimizer_step_temporaries():
    """CUDA (foreach AdamW): sqrt(v) of the larger param group at once; CPU: two fp32 temporaries of the
    largest tensor; distributed optimizer: the local shard."""
    decay = sum(numel(s) for s in SHAPES if len(s) >= 2)
    assert optimizer_step_temporary(CONFIG, MemoryLayout(device_type="cuda"), SHAPES) == 4 * decay
    assert optimizer_step_temporary(CONFIG, MemoryLayout(device_type="cpu"), SHAPES) == 2 * 4 * 1024 * 64
    sharded = MemoryLayout(dp=4, distributed_optimizer=True)
    assert optimizer_step_temporary(CONFIG, sharded, SHAPES) == 4 * N // 4


def test_layout_validation():
    with pytest.raises(ValueError, match="tp must be >= 1"):
        MemoryLayout(tp=0)
    with pytest.raises(ValueError, match="pipeline-parallel size > 1"):
        MemoryLayout(virtual_stages=2)
    with pytest.raises(ValueError, match="offload"):
        MemoryLayout(offload_optimizer_fraction=1.5)
    with pytest.raises(ValueError, match="device_type"):
        MemoryLayout(device_type="tpu")
