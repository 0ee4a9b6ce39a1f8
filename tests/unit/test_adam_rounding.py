"""adam_rounding: an exact fp32 fma, and the offloaded CPU step bit-equal to ShardedAdamW's.

fma32 is checked against exact rational arithmetic (random operands and a case where plain
float64 double rounding is wrong); CpuAdamW with rounding="cpu" gives the masters and moments
of ShardedAdamW stepping the same shard on CPU, bit for bit, over two steps with weight decay
and --decoupled-lr ranges; torch's fused CPU kernel (the default) does not.
"""

from __future__ import annotations

import struct
from fractions import Fraction

import pytest
import torch

from megatron.core.optimizer.adam_rounding import fma32, fp32, step_as
from megatron.core.optimizer.adamw import ShardedAdamW
from megatron.core.optimizer.cpu_adam import CpuAdamW
from megatron.core.optimizer.shards import FlatShard

HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _round_fp32(exact: Fraction) -> float:
    """The fp32 nearest `exact`, ties to even (candidates around float32(float(exact)))."""
    near = torch.tensor(float(exact), dtype=torch.float32)
    inf = torch.tensor(float("inf"))
    candidates = [near, torch.nextafter(near, inf), torch.nextafter(near, -inf)]

    def key(c):
        return abs(Fraction(c.item()) - exact), int(c.view(torch.int32).item()) & 1

    return min(candidates, key=key).item()


def test_fma32_rounds_once():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(300, generator=gen) * torch.logspace(-6, 3, 300)
    b = torch.randn(300, generator=gen)
    c = torch.randn(300, generator=gen) * torch.logspace(3, -6, 300)
    # double rounding through float64 is wrong here: a * b = 64 * (1 - 2^-46), c = 2^30 + 2^7 (odd in fp32);
    # the exact sum is just below the midpoint c + 2^6, so fp32 rounds down, while float64 rounds to that midpoint
    hard = (_f32(64 * (1 + 2**-23)), _f32(1 - 2**-23), float(2**30 + 2**7))
    mirrored = (-hard[0], hard[1], -hard[2])  # the same below zero
    a, b, c = (torch.cat([t, torch.tensor([h, m])]) for t, h, m in zip((a, b, c), hard, mirrored))
    got = fma32(a, b, c)
    for x, y, z, out in zip(a.tolist(), b.tolist(), c.tolist(), got.tolist()):
        assert out == _round_fp32(Fraction(x) * Fraction(y) + Fraction(z)), (x, y, z)
    assert got[-2].item() == hard[2] != (a[-2].double() * b[-2].double() + c[-2].double()).float().item()
    assert got[-1].item() == -hard[2]


def _shard(n: int, gen) -> FlatShard:
    main = torch.randn(n, generator=gen) * 0.02
    grad = torch.randn(n, generator=gen) * 1e-3
    # per-parameter ranges, as build_shards makes them: decay on most, none on a norm-like piece; the first
    # piece is the embedding (--decoupled-lr)
    return FlatShard(main, grad, main.clone(), [], [(0, 40), (40, 100), (130, n)], [(0, n)], [(0, 40)])


@pytest.mark.parametrize("decoupled_lr", [None, 1e-3])
def test_cpu_rounding_equals_sharded_adamw_bitwise(decoupled_lr):
    gen = torch.Generator().manual_seed(1)
    n = 4099  # not a multiple of any vector width: the kernels' tails run too
    reference = _shard(n, gen)
    ours = FlatShard(reference.main.clone(), reference.grad.clone(), reference.model, [], reference.decay,
                     reference.counted, reference.decoupled)  # fmt: skip
    fused = FlatShard(reference.main.clone(), reference.grad.clone(), reference.model, [], reference.decay,
                      reference.counted, reference.decoupled)  # fmt: skip
    adam = ShardedAdamW([reference], **HYPER)
    adam.decoupled_lr = decoupled_lr
    steppers = {}
    for name, shard in (("cpu", ours), ("fused", fused)):
        m, v = torch.zeros(n), torch.zeros(n)
        steppers[name] = (CpuAdamW(shard.main, shard.grad, m, v, shard.decay, shard.decoupled, rounding=name), m, v)
    for step in (1, 2):
        if step == 2:
            new = torch.randn(n, generator=gen) * 1e-3
            for shard in (reference, ours, fused):
                shard.grad.copy_(new)
        adam.step()
        for stepper, _, _ in steppers.values():
            stepper.step(step, HYPER["lr"], decoupled_lr, HYPER["betas"], HYPER["eps"], HYPER["weight_decay"])
        _, m, v = steppers["cpu"]
        assert torch.equal(ours.main, reference.main), f"step {step}: {(ours.main != reference.main).sum()} differ"
        assert torch.equal(m, adam.exp_avg[0]) and torch.equal(v, adam.exp_avg_sq[0])
    assert (fused.main != reference.main).sum() > 0  # why the default (torch's fused kernel) cannot match


def test_cuda_rounding_differs_where_cuda_kernels_differ():
    """The CUDA emulation is not the CPU ops under another name: reciprocal multiply and fmas move
    some last bits (how many is what the GPU check compares with a real device)."""
    gen = torch.Generator().manual_seed(2)
    n = 1 << 16
    tensors = {}
    for rounding in ("cpu", "cuda"):
        gen.manual_seed(2)
        main, grad = torch.randn(n, generator=gen) * 0.02, torch.randn(n, generator=gen) * 1e-3
        m, v = torch.zeros(n), torch.zeros(n)
        step_as(rounding, main, grad, m, v, step=1, **HYPER)
        tensors[rounding] = main
    differ = (tensors["cpu"] != tensors["cuda"]).sum().item()
    assert 0 < differ < n // 2
    # last bits only: a couple of ulps of the larger of the weight and the step's update (about lr)
    gap = (tensors["cpu"] - tensors["cuda"]).abs()
    assert (gap <= 2 * torch.finfo(torch.float32).eps * (tensors["cpu"].abs() + HYPER["lr"])).all()
    assert fp32(0.1) == _f32(0.1)
    with pytest.raises(ValueError, match="rounding"):
        CpuAdamW(main, grad, m, v, [], [], rounding="gpu")
