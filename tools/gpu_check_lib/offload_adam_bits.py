"""Part offload, issue 42 item 2: where the bf16 offload difference comes from, bit by bit.

1. `adam_bits` table: the same fp32 masters and gradients (two steps, the second on new
   gradients) stepped by ShardedAdamW on the device (what a device shard runs) and by the
   offload optimizer's CPU step on host copies, in each rounding of cpu_adam.CpuAdamW: torch's
   fused CPU kernel (the default), the CPU's single-tensor ops, and the CUDA kernels' rounding
   emulated (megatron/core/optimizer/adam_rounding.py). Beside them the device's own noise
   floor: torch's fused and multi-tensor AdamW on the device against the single-tensor path,
   and one reduction (the gradient's squared norm) summed in two orders.
2. `adam_bits_runs` table: the 0.17B offload model (offload_check.small_flags), bf16, 5
   iterations, the distributed optimizer on the device against `--optimizer-cpu-offload` with
   the default rounding and with the device's: fp32 masters after the first step compared
   bitwise, and the losses of every iteration.
On a dry run the device is the CPU: every cell is measured there (the CPU's own rounding).
"""

from __future__ import annotations

import functools

import torch

from megatron.core.optimizer.adamw import ShardedAdamW
from megatron.core.optimizer.cpu_adam import CpuAdamW
from megatron.core.optimizer.shards import FlatShard
from tools.gpu_check_lib.offload_check import BF16, DISTOPT, OFFLOAD, small_flags
from tools.gpu_check_lib.runs import train

HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # the offload runs' betas; Llama's decay
NUMEL = {"real": 1 << 24, "dry": 1 << 16}
CHUNKS = 64  # the second order of the reduction: per-chunk sums, added last chunk first


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Elements that differ, their share, and the largest difference in units in the last place."""
    a, b = a.detach().float().cpu().flatten(), b.detach().float().cpu().flatten()
    differ = a != b
    ulps = (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()
    return {
        "elements differing": int(differ.sum()),
        "share": float(differ.float().mean()),
        "max ulps": int(ulps.max()) if differ.any() else 0,
    }


def _inputs(n: int, device: torch.device):
    gen = torch.Generator().manual_seed(42)
    main = torch.randn(n, generator=gen) * 0.02
    grads = [torch.randn(n, generator=gen) * 1e-3 for _ in range(2)]
    return main.to(device), [g.to(device) for g in grads]


def _sharded(main, grads):
    shard = FlatShard(main.clone(), grads[0].clone(), main, [], [(0, main.numel())], [(0, main.numel())])
    adam = ShardedAdamW([shard], **HYPER)
    for grad in grads:
        shard.grad.copy_(grad)
        adam.step()
    return shard.main


def _cpu(main, grads, rounding: str):
    p, g = main.cpu().clone(), grads[0].cpu().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    stepper = CpuAdamW(p, g, m, v, [(0, p.numel())], [], rounding=rounding)
    for step, grad in enumerate(grads, 1):
        g.copy_(grad.cpu())
        stepper.step(step, HYPER["lr"], None, HYPER["betas"], HYPER["eps"], HYPER["weight_decay"])
    return p


def _torch_adamw(main, grads, **mode):
    param = torch.nn.Parameter(main.clone())
    optimizer = torch.optim.AdamW([param], **HYPER, **mode)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    return param.detach()


def _reduction_orders(grad: torch.Tensor) -> float:
    one = grad.square().sum()
    chunks = [c.square().sum() for c in grad.chunk(CHUNKS)]
    other = torch.zeros((), device=grad.device)
    for partial in reversed(chunks):
        other = other + partial
    return abs(one.item() - other.item()) / one.item()


def micro_table(report, ctx) -> None:
    section = report.section(
        "adam_bits",
        "AdamW, one shard, two steps: fp32 masters against ShardedAdamW on the device, bitwise",
        ["compared", "where", "elements", "elements differing", "share", "max ulps"],
    )
    n = NUMEL["dry" if ctx.dry_run else "real"]
    main, grads = _inputs(n, ctx.device)
    device = _sharded(main, grads)
    here = ctx.device.type
    rows = [
        ("offload CPU step, torch's fused CPU AdamW (default)", "host", _cpu(main, grads, "fused")),
        ("offload CPU step, CPU single-tensor rounding", "host", _cpu(main, grads, "cpu")),
        ("offload CPU step, CUDA rounding emulated", "host", _cpu(main, grads, "cuda")),
        ("noise floor: torch AdamW fused", here, _torch_adamw(main, grads, fused=True)),
        ("noise floor: torch AdamW foreach (multi-tensor)", here, _torch_adamw(main, grads, foreach=True)),
        ("noise floor: torch AdamW single-tensor", here, _torch_adamw(main, grads, foreach=False)),
    ]
    for name, where, masters in rows:
        section.add(compared=name, where=where, elements=n, **compare(masters, device))
    section.notes.append(
        f"reference: ShardedAdamW (megatron/core/optimizer/adamw.py) on {here}; masters randn * 0.02, gradients "
        f"randn * 1e-3, lr {HYPER['lr']:g}, betas {HYPER['betas']}, eps {HYPER['eps']:g}, weight decay "
        f"{HYPER['weight_decay']:g}; max ulps: the largest difference of the fp32 bit patterns"
    )
    section.notes.append(
        f"a reduction in two orders on {here}: relative difference of sum(g^2) as one sum and as {CHUNKS} chunk sums "
        f"added last first: {_reduction_orders(grads[0]):.2e}"
    )


def _masters(trainer) -> torch.Tensor:
    return torch.cat([shard.main.detach().float().cpu() for shard in trainer.optimizer.shards])


def _capture(into: dict, trainer) -> None:
    into["masters"] = _masters(trainer)


def _set_rounding(rounding: str):
    def prepare(trainer):
        for stepper in trainer.optimizer.adam.offload.cpu.values():
            stepper.rounding = rounding

    return prepare


def runs_table(report, ctx) -> None:
    section = report.section(
        "adam_bits_runs",
        "Offload vs device, bf16 0.17B model: fp32 masters after the first step, losses over 5 iterations",
        ["run", "CPU step rounding", "elements", "elements differing", "share", "max ulps", "losses",
         "max relative loss difference", "verdict"],
    )  # fmt: skip
    argv = small_flags(ctx.dry_run, 5) + BF16 + DISTOPT
    matched = ctx.device.type
    runs = (("distributed optimizer, device", None, []), ("optimizer offload 1", "fused", OFFLOAD),
            ("optimizer offload 1", matched, OFFLOAD))  # fmt: skip
    reference = None
    for name, rounding, flags in runs:
        skipped = ctx.skip(20)
        if skipped:
            section.add(run=name, verdict=skipped)
            continue
        captured: dict = {}
        measured = train(
            ctx, argv + flags, iters=4, warmup=1, hooks=functools.partial(_capture, captured),
            prepare=_set_rounding(rounding) if rounding else None,
        )  # fmt: skip
        row = {
            "run": name,
            "CPU step rounding": rounding or "-",
            "losses": ", ".join(f"{x:.5f}" for x in measured.losses),
        }
        if measured.error:
            section.add(**row, verdict=f"failed: {measured.error}")
            continue
        if reference is None:
            reference = (captured["masters"], measured.losses)
            section.add(**row, elements=captured["masters"].numel(), verdict="reference")
            continue
        bits = compare(captured["masters"], reference[0])
        loss_gap = max(abs(a - b) / abs(b) for a, b in zip(measured.losses, reference[1]))
        verdict = "bit-equal" if bits["elements differing"] == 0 and loss_gap == 0 else "differs"
        section.add(**row, elements=captured["masters"].numel(), **bits, **{"max relative loss difference": loss_gap},
                    verdict=verdict)  # fmt: skip
    section.notes.append(
        f"the CPU step's rounding: 'fused' is torch's fused CPU AdamW (the default), '{matched}' computes "
        f"ShardedAdamW's ops as {matched} kernels round them (megatron/core/optimizer/adam_rounding.py); gradients "
        "reach the host in fp32 (the gradient buffer's fp32 shard); bf16 weights are the masters cast by copy_ "
        "(round to nearest even) on both sides"
    )


def check_adam_bits(report, ctx) -> None:
    micro_table(report, ctx)
    runs_table(report, ctx)
