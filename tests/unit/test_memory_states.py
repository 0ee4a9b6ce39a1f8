"""Weights, gradients and optimizer bytes, exact to our flat buffers (bucket padding) and ShardedAdamW."""

import dataclasses

import pytest
import torch

from megatron.core.distributed.bucket_layout import SHARD_ALIGN, BufferLayout
from megatron.core.distributed.model_chunk_buffers import DDPConfig
from megatron.core.optimizer.config import OffloadConfig
from megatron.core.parallel_config import ParallelConfig
from megatron.core.transformer.config import TransformerConfig
from megatron.planning import MemoryLayout
from megatron.planning.model_states import chunk_buffers, gathered_bytes, model_states, optimizer_step_temporary
from megatron.planning.parameters import ModelChunk, chunk_shapes, numel
from megatron.planning.step_time import dp_collectives

CONFIG = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=32)
SHAPES = [(256, 64), (64,), (1024, 64), (64, 256)]
N = sum(numel(s) for s in SHAPES)


def buffer(shards=1, bucket_size=10**8):
    return BufferLayout([(str(i), numel(s), False) for i, s in enumerate(SHAPES)], bucket_size, shards, SHARD_ALIGN)


def states(dtype, shards=1, bucket_size=10**8, parallel=None, offload=None, device_type="cuda"):
    config = dataclasses.replace(CONFIG, params_dtype=dtype)
    layout = MemoryLayout(parallel or ParallelConfig(), offload=offload or OffloadConfig(), device_type=device_type)
    return model_states(config, layout, [[buffer(shards, bucket_size)]])


def test_fp32_weights_are_their_own_master():
    """fp32: 4 (weights) + 4 (fp32 main_grad) + 8 (Adam m, v); no master copy, no per-tensor step count."""
    for device_type in ("cpu", "cuda"):
        s = states(torch.float32, device_type=device_type)
        assert (s.weights_bytes, s.grads_bytes, s.optimizer_bytes) == (4 * N, 4 * N, 8 * N)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_weights_have_fp32_master(dtype):
    """bf16/fp16: 2 + 4 (fp32 main_grad) + 12 (fp32 master + m + v) = 18 bytes per parameter."""
    s = states(dtype)
    assert (s.weights_bytes, s.grads_bytes, s.optimizer_bytes) == (2 * N, 4 * N, 12 * N)


@pytest.mark.parametrize("d", [1, 2, 4, 8, 64])
def test_distributed_optimizer_is_6_plus_12_over_d_plus_padding(d):
    """One bucket padded to a multiple of d x 64 elements: buffers hold the padding, each rank 1/d of it."""
    padded = -(-N // (d * SHARD_ALIGN)) * d * SHARD_ALIGN
    s = states(torch.bfloat16, shards=d)
    assert (s.parameters, s.weights_bytes, s.grads_bytes, s.optimizer_bytes) == (
        N,
        2 * padded,
        4 * padded,
        12 * padded // d,
    )
    if N % (d * SHARD_ALIGN) == 0:
        assert s.device_bytes / N == pytest.approx(6 + 12 / d, rel=0, abs=1e-12)


def test_every_bucket_is_padded():
    """A bucket closes after the parameter that brings it to bucket_size elements; each one is padded."""
    s = states(torch.float32, shards=3, bucket_size=20_000)
    sizes = [256 * 64 + 64 + 1024 * 64, 64 * 256]
    padded = sum(-(-n // (3 * SHARD_ALIGN)) * 3 * SHARD_ALIGN for n in sizes)
    assert (s.weights_bytes, s.optimizer_bytes) == (4 * padded, 8 * padded // 3)


def test_chunk_buffer_follows_the_run():
    """dp x cp shards with the distributed optimizer; the tied embedding of a first stage in its own bucket."""
    first = ModelChunk(0, (0,), True, False)
    layout = MemoryLayout(
        ParallelConfig(dp=2, cp=2, pp=2, ddp=DDPConfig(bucket_size=10**8, use_distributed_optimizer=True))
    )
    (built,) = chunk_buffers(CONFIG, layout, first)
    assert built.shards == 4 and len(built.buckets) == 2
    assert built.buckets[-1].numel == -(-numel(chunk_shapes(CONFIG, 1, first)[0]) // 256) * 256
    (whole,) = chunk_buffers(CONFIG, MemoryLayout(ParallelConfig(dp=2)), ModelChunk(0, (0, 1), True, True))
    assert len(whole.buckets) == 1


@pytest.mark.parametrize("dtype,on_device", [(torch.float32, 8), (torch.bfloat16, 12)])
def test_offload_moves_whole_chunks_to_host(dtype, on_device):
    """16 host bytes per offloaded element (fp32 master even of fp32 weights, m, v, gradient copy);
    the static policy offloads the chunks the forward reaches last (the first bucket, which holds the
    last parameters), nearest to the fraction; weights and gradients never move."""

    def offloaded(fraction, policy="static"):
        parallel = ParallelConfig(dp=2, ddp=DDPConfig(use_distributed_optimizer=True))
        offload = OffloadConfig(enabled=bool(fraction) or policy == "auto", fraction=fraction, policy=policy)
        return states(dtype, shards=2, bucket_size=20_000, parallel=parallel, offload=offload)

    first, second = (buffer(2, 20_000).buckets[i].shard_numel for i in (0, 1))
    plain, full, half = offloaded(0.0), offloaded(1.0), offloaded(0.5)
    assert (plain.optimizer_bytes, plain.host_bytes) == (on_device * (first + second), 0)
    assert (full.optimizer_bytes, full.host_bytes) == (0, 16 * (first + second))
    assert first > second and (half.optimizer_bytes, half.host_bytes) == (on_device * second, 16 * first)
    assert offloaded(1.0, policy="auto") == full
    assert (half.weights_bytes, half.grads_bytes) == (plain.weights_bytes, plain.grads_bytes)


def test_host_resident_gradients_and_parameters():
    """optim_grads_params with gradient and parameter shards on host too: the device keeps none
    of a host chunk's state; the host slab holds 16 bytes per element of optimizer state (the
    gradient shard is its own host copy), the parameter shard in the model dtype, and two
    staging slots of the largest host gradient shard (fp32)."""

    def placed(optimizer, grads, params):
        parallel = ParallelConfig(dp=2, ddp=DDPConfig(sharding_strategy="optim_grads_params"))
        offload = OffloadConfig(enabled=True, fraction=optimizer, grad_fraction=grads, param_fraction=params)
        return states(torch.bfloat16, shards=2, bucket_size=20_000, parallel=parallel, offload=offload)

    first, second = (buffer(2, 20_000).buckets[i].shard_numel for i in (0, 1))
    full = placed(1.0, 1.0, 1.0)
    assert (full.weights_bytes, full.grads_bytes, full.optimizer_bytes) == (0, 0, 0)
    assert full.host_bytes == 16 * (first + second) + 2 * (first + second) + 2 * 4 * first
    half = placed(1.0, 0.5, 0.5)  # the first chunk in backward order is the last the forward uses
    assert (half.weights_bytes, half.grads_bytes, half.optimizer_bytes) == (2 * second, 4 * second, 0)
    assert half.host_bytes == 16 * (first + second) + 2 * first + 2 * 4 * first
    with pytest.raises(ValueError, match="need --param-offload-fraction"):
        placed(1.0, 0.5, 1.0)
    with pytest.raises(ValueError, match="grad_offload_fraction needs a strategy that shards gradients"):
        states(
            torch.bfloat16,
            shards=2,
            parallel=ParallelConfig(dp=2, ddp=DDPConfig(use_distributed_optimizer=True)),
            offload=OffloadConfig(enabled=True, fraction=1.0, grad_fraction=1.0),
        )


def test_offloaded_shards_have_no_device_step_temporaries():
    buffers = [buffer(shards=2, bucket_size=20_000)]
    first, second = (buffers[0].buckets[i].shard_numel for i in (0, 1))
    assert optimizer_step_temporary(buffers) == 2 * 4 * first
    assert optimizer_step_temporary(buffers, 0.5) == 2 * 4 * second
    assert optimizer_step_temporary(buffers, 1.0) == 0


def test_optimizer_step_temporaries():
    """ShardedAdamW steps shard by shard on every device: two fp32 tensors of the largest shard."""
    assert optimizer_step_temporary([buffer()]) == 2 * 4 * N
    assert optimizer_step_temporary([buffer(bucket_size=20_000)]) == 2 * 4 * (256 * 64 + 64 + 1024 * 64)
    padded = -(-N // (4 * SHARD_ALIGN)) * 4 * SHARD_ALIGN
    assert optimizer_step_temporary([buffer(shards=4)]) == 2 * 4 * padded // 4


def test_layout_validation():
    with pytest.raises(ValueError, match="tp must be >= 1"):
        ParallelConfig(tp=0)
    with pytest.raises(ValueError, match="pipeline-parallel size > 1"):
        ParallelConfig(virtual_stages=2)
    with pytest.raises(ValueError, match="offload-fraction must be in"):
        OffloadConfig(enabled=True, fraction=1.5)
    with pytest.raises(ValueError, match="offload needs the distributed optimizer"):
        MemoryLayout(offload=OffloadConfig(enabled=True, fraction=0.5))
    with pytest.raises(ValueError, match="device_type"):
        MemoryLayout(device_type="tpu")
    with pytest.raises(ValueError, match="bucket-size"):
        DDPConfig(bucket_size=0)


def sharded(d, pp, strategy, reshard_after_forward):
    ddp = DDPConfig(sharding_strategy=strategy, reshard_after_forward=reshard_after_forward)
    return ParallelConfig(dp=d, pp=pp, ddp=ddp)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("pp", [1, 2])
def test_sharding_strategies_keep_shards_and_gather_whole_buckets(strategy, pp):
    """bf16 weights, one bucket (d = 4): optim keeps 2 + 4 bytes per padded element whole; optim_grads
    keeps the fp32 gradient as a 1/d shard and holds whole gradient buckets (3 of the largest, one
    more where the tied embedding and output layer share the only stage) only during
    forward/backward; optim_grads_params does so for the weights too, but under pipeline
    parallelism every bucket's weights stay gathered through the step."""
    d = 4
    padded = -(-N // (d * SHARD_ALIGN)) * d * SHARD_ALIGN
    s = states(torch.bfloat16, shards=d, parallel=sharded(d, pp, strategy, reshard_after_forward=pp == 1))
    grads_sharded, params_sharded = strategy != "optim", strategy == "optim_grads_params"
    assert s.weights_bytes == 2 * padded // (d if params_sharded else 1)
    assert s.grads_bytes == 4 * padded // (d if grads_sharded else 1)
    assert s.optimizer_bytes == 12 * padded // d
    held = 3 + (pp == 1)  # CONFIG ties the embedding and the output layer
    whole_grads = held * 4 * padded if grads_sharded else 0
    whole_params = (2 * padded if pp > 1 else held * 2 * padded) if params_sharded else 0
    assert s.gathered_bytes == whole_grads + whole_params
    resharded = states(torch.bfloat16, shards=d, parallel=sharded(d, pp, strategy, reshard_after_forward=True))
    assert resharded.gathered_bytes == whole_grads + (held * 2 * padded if params_sharded else 0)
    assert DDPConfig(sharding_strategy=strategy).use_distributed_optimizer
    assert DDPConfig(use_distributed_optimizer=True).sharding_strategy == "optim"


def test_unsharded_grad_accumulation_holds_every_whole_gradient_and_reduces_once():
    buffers = [buffer(shards=2, bucket_size=20_000)]
    ddp = DDPConfig(sharding_strategy="optim_grads", unsharded_grad_accumulation=True)
    layout = MemoryLayout(ParallelConfig(dp=2, ddp=ddp), num_microbatches=4)
    assert gathered_bytes(CONFIG, layout, [buffers]) == 4 * buffers[0].numel
    assert dp_collectives(layout) == (1, 1)
    assert dp_collectives(layout.with_ddp(unsharded_grad_accumulation=False)) == (4, 1)
    with pytest.raises(ValueError, match="unsharded-grad-accumulation applies to the optim_grads"):
        DDPConfig(use_distributed_optimizer=True, unsharded_grad_accumulation=True)
