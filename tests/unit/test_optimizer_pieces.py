"""Learning-rate schedule against hand-computed values; loss scaler rules; clipping; bucket layout
(padding, shards, straddling parameters); flat-shard AdamW against torch.optim.AdamW; the weight
decay rule by name."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.core.distributed.bucket_layout import BufferLayout, default_bucket_size
from megatron.core.optimizer.adamw import ShardedAdamW
from megatron.core.optimizer.grad_preparation import clip_grads
from megatron.core.optimizer.grad_scaler import DynamicGradScaler
from megatron.core.optimizer.lr_schedule import LRSchedule
from megatron.core.optimizer.shards import FlatShard, weight_decay_applies


def lr(i, style, warmup=2, decay=10):
    return LRSchedule(max_lr=1.0, min_lr=0.1, style=style, warmup_steps=warmup, decay_steps=decay)(i)


@pytest.mark.parametrize("iteration,expected", [(1, 0.5), (2, 1.0), (6, 0.55), (10, 0.1), (12, 0.1)])
def test_linear(iteration, expected):
    # after warm-up: 0.1 + 0.9 * (1 - (i - 2) / 8)
    assert lr(iteration, "linear") == pytest.approx(expected)


@pytest.mark.parametrize(
    "iteration,expected", [(1, 0.5), (2, 1.0), (6, 0.55), (4, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2), (10, 0.1)]
)
def test_cosine(iteration, expected):
    assert lr(iteration, "cosine") == pytest.approx(expected)


def test_constant_after_warmup_and_no_warmup():
    assert [lr(i, "constant") for i in (1, 2, 3, 50)] == [0.5, 1.0, 1.0, 1.0]
    assert lr(1, "linear", warmup=0, decay=4) == pytest.approx(0.1 + 0.9 * 0.75)


def test_dynamic_scaler_hysteresis_backoff_and_growth():
    scaler = DynamicGradScaler(initial_scale=1024.0, min_scale=256.0, growth_interval=3, hysteresis=2)
    scaler.update(found_inf=True)
    assert scaler.scale == 1024.0  # first overflow is absorbed by hysteresis
    scaler.update(found_inf=True)
    assert scaler.scale == 512.0
    scaler.update(found_inf=True)
    assert scaler.scale == 256.0
    scaler.update(found_inf=True)
    assert scaler.scale == 256.0  # never below min_scale
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 512.0
    assert scaler.state_dict()["hysteresis_tracker"] == 2  # a growth restores the full hysteresis
    scaler.update(found_inf=True)
    assert scaler.scale == 512.0  # so the first overflow after it is absorbed again
    scaler.update(found_inf=True)
    assert scaler.scale == 256.0


def test_clip_grads_scales_to_max_norm():
    grads = [torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0, 0.0])]
    clip_grads(grads, 5.0, 1.0)
    total = torch.cat(grads).norm().item()
    assert total == pytest.approx(1.0, rel=1e-5)
    clip_grads(grads, total, 2.0)  # below the threshold: unchanged
    assert torch.cat(grads).norm().item() == pytest.approx(1.0, rel=1e-5)


def test_layout_pads_buckets_into_equal_shards_and_pieces_cover_every_parameter():
    params = [("a", 10, False), ("b", 7, False), ("emb", 5, True), ("c", 3, False), ("d", 9, False)]
    layout = BufferLayout(params, bucket_size=12, shards=4, align=2)
    # a+b reach 12 -> bucket [0, 24) (17 padded to 8 x 3); emb alone [24, 32); c+d (12) [32, 48)
    assert [(b.start, b.end) for b in layout.buckets] == [(0, 24), (24, 32), (32, 48)]
    assert [(p.name, p.bucket, p.start) for p in layout.params] == [
        ("a", 0, 0),
        ("b", 0, 10),
        ("emb", 1, 24),
        ("c", 2, 32),
        ("d", 2, 35),
    ]
    assert all(b.numel % 8 == 0 for b in layout.buckets) and layout.numel == 48
    covered = {name: [] for name, *_ in params}
    for index, bucket in enumerate(layout.buckets):
        for rank in range(4):
            for piece in layout.pieces(index, rank):
                assert 0 <= piece.shard_start < piece.shard_end <= bucket.shard_numel
                covered[piece.name].append((piece.param_start, piece.numel))
    for name, numel, _ in params:  # every element of every parameter in exactly one shard
        spans = sorted(covered[name])
        assert spans[0][0] == 0 and sum(n for _, n in spans) == numel
        assert all(s + n == t for (s, n), (t, _) in zip(spans, spans[1:]))
    assert len(covered["a"]) == 2  # a (10 elements) straddles the shards of ranks 0 and 1 (6 each)


def test_layout_replicated_has_no_padding_and_default_bucket_size():
    layout = BufferLayout([("a", 10, False), ("b", 7, False)], bucket_size=100)
    assert layout.numel == 17 and [(b.start, b.end) for b in layout.buckets] == [(0, 17)]
    assert layout.pieces(0, 0)[1].shard_start == 10
    assert default_bucket_size(8) == 40_000_000 and default_bucket_size(64) == 64_000_000


@pytest.mark.parametrize(
    "name,decays",
    [
        ("embedding.word_embeddings.weight", True),
        ("output_layer.weight", True),
        ("decoder.layers.0.self_attention.linear_qkv.weight", True),
        ("decoder.layers.3.mlp.linear_fc2.weight", True),
        ("embedding.position_embeddings.weight", True),
        ("decoder.layers.0.self_attention.linear_qkv.bias", False),
        ("decoder.layers.0.input_layernorm.weight", False),
        ("decoder.layers.0.pre_mlp_layernorm.bias", False),
        ("decoder.final_layernorm.weight", False),
    ],
)
def test_weight_decay_by_name(name, decays):
    assert weight_decay_applies(name) is decays


def test_flat_shard_adamw_equals_torch_adamw():
    """Two parameters (one decayed, one not) in one flat shard; 3 steps with changing lr."""
    torch.manual_seed(0)
    weight, bias = torch.randn(4, 3), torch.randn(3)
    reference = [torch.nn.Parameter(weight.clone()), torch.nn.Parameter(bias.clone())]
    torch_adam = torch.optim.AdamW(
        [{"params": [reference[0]], "weight_decay": 0.1}, {"params": [reference[1]], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    main = torch.cat([weight.reshape(-1), bias])
    shard = FlatShard(main=main, grad=torch.zeros_like(main), model=main, pieces=[], decay=[(0, 12)], counted=[])
    ours = ShardedAdamW([shard], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step, lr in enumerate((1e-2, 5e-3, 2e-3)):
        grads = [torch.randn(4, 3), torch.randn(3)]
        for param, grad in zip(reference, grads):
            param.grad = grad
        shard.grad.copy_(torch.cat([g.reshape(-1) for g in grads]))
        for group in torch_adam.param_groups:
            group["lr"] = lr
        ours.lr = lr
        torch_adam.step()
        ours.step()
        expected = torch.cat([p.detach().reshape(-1) for p in reference])
        torch.testing.assert_close(main, expected, rtol=1e-6, atol=1e-7, msg=f"step {step + 1}")
