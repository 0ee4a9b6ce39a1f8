"""Part kernels-step, 2 and 3: the one-GPU training step (ours vs a bare PyTorch loop) and the
memory estimate vs the CUDA allocator in five configurations."""

from __future__ import annotations

import time

import torch

from megatron.core.transformer.flops import flops_per_iteration
from megatron.training.kernel_paths import startup_kernel_paths
from tools.gpu_check_lib.bare_llama import BareLoop
from tools.gpu_check_lib.env import estimate_run
from tools.gpu_check_lib.report import GIB, NA, gib
from tools.gpu_check_lib.runs import SyncCounter, error_line, free_device_memory, run_config, train

# Llama-3.2-1B's shape with a 32k vocabulary: 1.10B parameters
REAL_MODEL = dict(layers=16, hidden=2048, ffn=8192, heads=32, groups=8, seq=4096, vocab=32000)
DRY_MODEL = dict(layers=2, hidden=64, ffn=128, heads=4, groups=2, seq=32, vocab=256)
REAL_ITERS, DRY_ITERS = (3, 20), (1, 2)  # (warm-up, timed)
MEMORY_CONFIGS = (
    ("recompute none, mbs 1", 1, []),
    ("recompute selective, mbs 1", 1, ["--recompute-granularity", "selective"]),
    (
        "recompute full, mbs 1",
        1,
        ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    ),
    ("recompute none, mbs 4", 4, []),
    ("--optimizer-cpu-offload, mbs 1", 1, ["--use-distributed-optimizer", "--optimizer-cpu-offload"]),
)


def model_flags(dry_run: bool, micro_batch: int = 1, microbatches: int = 8, iters: int = 23) -> list[str]:
    m = DRY_MODEL if dry_run else REAL_MODEL
    argv = ["--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden"]), "--ffn-hidden-size", str(m["ffn"])]
    argv += [
        "--num-attention-heads",
        str(m["heads"]),
        "--group-query-attention",
        "--num-query-groups",
        str(m["groups"]),
    ]
    argv += ["--seq-length", str(m["seq"]), "--max-position-embeddings", str(m["seq"]), "--vocab-size", str(m["vocab"])]
    argv += ["--micro-batch-size", str(micro_batch), "--global-batch-size", str(micro_batch * microbatches)]
    return argv + ["--train-iters", str(iters), "--bf16", "--mock-data", "--lr", "1e-4", "--lr-decay-style", "constant"]


def _bare(ctx, run, warmup: int, iters: int) -> dict:
    free_device_memory(ctx)
    loop = BareLoop(run, ctx.device)
    losses = [loop.step() for _ in range(warmup)]
    ctx.sync()
    start = time.perf_counter()
    with SyncCounter(ctx.cuda) as syncs:
        losses += [loop.step() for _ in range(iters)]
        ctx.sync()
    elapsed = time.perf_counter() - start
    out = dict(losses=[x.item() for x in losses], step_s=NA if ctx.dry_run else elapsed / iters)
    out["syncs"] = syncs.count / iters if ctx.cuda else NA
    out["max_allocated"] = torch.cuda.max_memory_allocated() if ctx.cuda else NA
    del loop
    free_device_memory(ctx)
    return out


def check_step(report, ctx, peak) -> None:
    """`peak`: (dense bf16 TFLOP/s, what it is) or (None, why not)."""
    section = report.section(
        "train_step",
        "One-GPU training step (Llama, bf16, our kernels; sizes in the notes)",
        ["path", "iterations", "first loss", "last loss", "step ms", "tokens/s", "TFLOP/s/GPU", "MFU", "vs bare",
         "host syncs/iter", "max allocated GiB"],
    )  # fmt: skip
    warmup, iters = DRY_ITERS if ctx.dry_run else REAL_ITERS
    argv = model_flags(ctx.dry_run, iters=warmup + iters)
    run = run_config(argv)
    tokens = run.training.global_batch_size * run.model.seq_length
    flops = flops_per_iteration(run.model, run.training.global_batch_size)
    ours = train(ctx, argv, iters, warmup, count_syncs=True)
    ours_row = dict(path="ours (Trainer.train_step)", **_figures(ctx, ours.__dict__, tokens, flops, peak))
    if ours.error:
        ours_row["path"] += f" -- {ours.error}"
    try:
        bare = _bare(ctx, run, warmup, iters)
    except Exception as error:  # out of memory, a missing fused AdamW: the row says so
        bare = dict(losses=[], step_s=NA if ctx.dry_run else None, syncs=None, max_allocated=None)
        section.notes.append(f"bare loop failed: {error_line(error)}")
    bare_row = dict(path="bare PyTorch (SDPA, AdamW fused)", **_figures(ctx, bare, tokens, flops, peak))
    if ctx.dry_run:
        ours_row["vs bare"] = NA
    elif isinstance(ours.step_s, float) and isinstance(bare["step_s"], float):
        ours_row["vs bare"] = bare["step_s"] / ours.step_s
    for row in (ours_row, bare_row):
        section.add(iterations=f"{warmup} + {iters}", **row)
    section.notes += [
        f"model: {run.model.num_layers} layers, hidden {run.model.hidden_size}, {sum(_parameter_count(run)):,} "
        f"parameters, micro batch {run.training.micro_batch_size} x {run.training.num_microbatches} microbatches, "
        f"{tokens} tokens per iteration; TFLOP/s: megatron/core/transformer/flops.py (the log line's)",
        f"MFU: TFLOP/s / the dense bf16 peak: {peak[1]}",
        "our kernels as the start-up log names them: "
        + "; ".join(f"{k} {v}" for k, v in startup_kernel_paths(run.model, ctx.device).items())
        + "; the loop is pretrain.train's without its log line, validation and checkpoints",
        "vs bare: bare step time / ours (above 1: ours faster); host syncs: set_sync_debug_mode('warn') warnings per "
        f"timed iteration (the README expects 1 for ours: the grad norm); where: {', '.join(ours.sync_sites) or '-'}",
    ]


def _parameter_count(run):
    from tools.gpu_check_lib.bare_llama import BareLlama

    with torch.device("meta"):
        return [p.numel() for p in BareLlama(run.model).parameters()]


def _figures(ctx, m: dict, tokens: int, flops: float, peak) -> dict:
    losses, step = m["losses"], m["step_s"]
    out = {"first loss": losses[0] if losses else None, "last loss": losses[-1] if losses else None}
    out["step ms"] = step * 1e3 if isinstance(step, float) else step
    out["tokens/s"] = tokens / step if isinstance(step, float) else step
    tflops = flops / step / 1e12 if isinstance(step, float) else step
    out["TFLOP/s/GPU"] = tflops
    out["MFU"] = tflops / peak[0] if isinstance(tflops, float) and peak[0] else (NA if ctx.dry_run else None)
    out["host syncs/iter"] = m["syncs"]
    alloc = m["max_allocated"]
    out["max allocated GiB"] = gib(alloc)
    return out


def check_memory(report, ctx) -> None:
    section = report.section(
        "memory",
        "Memory estimate vs the CUDA allocator after 3 iterations",
        ["configuration", "certain GiB", "total GiB", "host GiB", "max allocated GiB", "max reserved GiB",
         "allocated / certain", "reserved / total", "allocated before GiB", "start-up check", "ran", "check right"],
    )  # fmt: skip
    device_bytes = torch.cuda.get_device_properties(ctx.device).total_memory if ctx.cuda else None
    for name, micro_batch, extra in MEMORY_CONFIGS:
        skipped = ctx.skip(45)
        if skipped:
            section.add(configuration=name, ran=skipped)
            continue
        argv = model_flags(ctx.dry_run, micro_batch, microbatches=2, iters=3) + extra
        estimate = estimate_run(run_config(argv), ctx.device, device_bytes)
        measured = train(ctx, argv, iters=3, warmup=0)
        ran = "yes" if measured.error is None else measured.error
        alloc, reserved = measured.max_allocated, measured.max_reserved
        right = NA
        if not ctx.dry_run:
            right = (estimate.decision == "refuses") == (measured.error == "out of memory")
        section.add(
            configuration=name,
            **{
                "certain GiB": estimate.certain / GIB,
                "total GiB": estimate.total / GIB,
                "host GiB": estimate.host / GIB,
                "max allocated GiB": gib(alloc),
                "max reserved GiB": gib(reserved),
                "allocated / certain": alloc / estimate.certain if isinstance(alloc, int) else alloc,
                "reserved / total": reserved / estimate.total if isinstance(reserved, int) else reserved,
                "allocated before GiB": gib(measured.allocated_before),
                "start-up check": estimate.decision,
                "ran": ran,
                "check right": right,
            },
        )
    section.notes.append(
        "certain = weights + grads + optimizer + saved activations (refused above the device); total adds the "
        "unmeasured transients and allowances; every configuration runs whatever the check says, so a refusal "
        "is right when the run ran out of memory and a start is right when it did not; allocated before: what "
        "the earlier runs of this process left allocated (0 when each run frees its memory)"
    )
