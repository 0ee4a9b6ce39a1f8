"""Part fp8: our BF16 step and each FP8 recipe at the 8B layer shape, beside torchtitan with torchao float8
(tensorwise, rowwise), and one layer's emulated FP8 product beside torch._scaled_mm's.

Section `fp8` has the rows the issue names (`ours-bf16`, `ours-tensorwise`, `ours-delayed`, `ours-blockwise`,
`torchtitan-bf16`, `torchtitan-tensorwise`, `torchtitan-rowwise`) with `tokens_per_s`, `speedup_vs_bf16`
(over our BF16 step), `mfu_bf16_equiv` (the model's FLOPs per second over the dense BF16 peak: FP8 counted as
BF16 work) and `final_loss` (after the timed steps). torchtitan 0.2.2 and torchao come as carried wheels on
the GPU machine; where they do not import, their rows say why. Section `fp8_layer` compares one linear
layer's product from the same FP8 operands: our fp32 emulation against torch._scaled_mm.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F

from megatron.core.fp8.gemm import device_has_fp8, emulated_mm
from megatron.core.fp8.scaling import amax, cast, current_scale
from megatron.core.transformer.flops import flops_per_iteration
from tools.gpu_check_lib.report import NA
from tools.gpu_check_lib.runs import error_line, free_device_memory, run_config, train

BUDGET_S = 240.0
# Llama-3.1-8B's layer (the throughput part's shape), two layers so that a run fits the part's budget
REAL = dict(layers=2, hidden=4096, ffn=14336, heads=32, groups=8, seq=4096, vocab=128256, micro_batch=1, mbs=2)
DRY = dict(layers=2, hidden=64, ffn=128, heads=4, groups=2, seq=32, vocab=256, micro_batch=1, mbs=2)
REAL_ITERS, DRY_ITERS = (3, 10), (1, 2)  # (warm-up, timed)
RECIPES = {
    "ours-bf16": [],
    "ours-tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "ours-delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
    "ours-blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
}
TORCHTITAN = {"torchtitan-bf16": None, "torchtitan-tensorwise": "tensorwise", "torchtitan-rowwise": "rowwise"}
COLUMNS = ["name", "tokens_per_s", "speedup_vs_bf16", "mfu_bf16_equiv", "final_loss", "error"]


def shape(dry_run: bool) -> dict:
    return DRY if dry_run else REAL


def ours_flags(m: dict, iters: int) -> list[str]:
    return [
        *("--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden"]), "--ffn-hidden-size", str(m["ffn"])),
        *("--num-attention-heads", str(m["heads"]), "--group-query-attention", "--num-query-groups", str(m["groups"])),
        *("--seq-length", str(m["seq"]), "--max-position-embeddings", str(m["seq"]), "--vocab-size", str(m["vocab"])),
        *("--micro-batch-size", str(m["micro_batch"]), "--global-batch-size", str(m["micro_batch"] * m["mbs"])),
        *("--train-iters", str(iters), "--bf16", "--mock-data", "--lr", "1e-4", "--lr-decay-style", "constant"),
    ]


def _row(name: str, step_s, losses, tokens: int, flops: float, peak, bf16_step) -> dict:
    row = dict(name=name, final_loss=losses[-1] if losses else None)
    if not isinstance(step_s, float):
        return {**row, "tokens_per_s": step_s, "speedup_vs_bf16": step_s, "mfu_bf16_equiv": step_s}
    row["tokens_per_s"] = tokens / step_s
    row["speedup_vs_bf16"] = bf16_step / step_s if isinstance(bf16_step, float) else None
    row["mfu_bf16_equiv"] = flops / step_s / 1e12 / peak[0] if peak[0] else None
    return row


def _torchtitan_loop(ctx, m: dict, recipe: str | None, warmup: int, iters: int):
    """torchtitan's Llama 3 with torchao's float8 training (`recipe`: torchao's recipe name, None: bf16),
    compiled as torchtitan runs it, bf16 autocast over fp32 weights, AdamW: (losses, step seconds)."""
    from torchtitan.models.llama3 import Transformer, llama3_configs

    args = dataclasses.replace(llama3_configs["8B"], n_layers=m["layers"], vocab_size=m["vocab"], max_seq_len=m["seq"])
    with torch.device(ctx.device):
        model = Transformer(args)
        model.init_weights()
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn != "output")
    compiled = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, m["vocab"], (m["micro_batch"], m["seq"] + 1), device=ctx.device)

    def step():
        for _ in range(m["mbs"]):
            with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
                logits = compiled(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) / m["mbs"]
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach() * m["mbs"]

    losses = [step() for _ in range(warmup)]
    ctx.sync()
    start = time.perf_counter()
    losses += [step() for _ in range(iters)]
    ctx.sync()
    return [x.item() for x in losses], (time.perf_counter() - start) / iters


def check_fp8(report, ctx, peak) -> None:
    """`peak`: (dense bf16 TFLOP/s or None, what it is). The part's own budget: BUDGET_S."""
    ctx = dataclasses.replace(ctx, budget_s=BUDGET_S)
    section = report.section("fp8", "FP8 training at the 8B layer shape (one GPU)", COLUMNS)
    m = shape(ctx.dry_run)
    warmup, iters = DRY_ITERS if ctx.dry_run else REAL_ITERS
    run = run_config(ours_flags(m, warmup + iters))
    tokens = run.training.global_batch_size * run.model.seq_length
    flops = flops_per_iteration(run.model, run.training.global_batch_size)
    bf16_step = None
    for name, extra in RECIPES.items():
        skipped = ctx.skip(30)
        if skipped:
            section.add(name=name, error=skipped)
            continue
        measured = train(ctx, ours_flags(m, warmup + iters) + extra, iters, warmup)
        step = measured.step_s if measured.error is None else None
        bf16_step = step if name == "ours-bf16" else bf16_step
        section.add(**_row(name, step, measured.losses, tokens, flops, peak, bf16_step), error=measured.error)
    for name, recipe in TORCHTITAN.items():
        skipped = "not run on CPU (torch.compile and float8 need the GPU)" if ctx.dry_run else ctx.skip(60)
        if skipped:
            section.add(name=name, tokens_per_s=NA if ctx.dry_run else None, error=skipped)
            continue
        try:
            losses, step = _torchtitan_loop(ctx, m, recipe, warmup, iters)
            section.add(**_row(name, step, losses, tokens, flops, peak, bf16_step))
        except Exception as error:  # not installed, another API, out of memory: the row says which
            section.add(name=name, error=error_line(error))
        free_device_memory(ctx)
    section.notes += [
        f"shape: {m['layers']} layers of hidden {m['hidden']}, ffn {m['ffn']}, {m['heads']} heads / {m['groups']} "
        f"groups, seq {m['seq']}, vocab {m['vocab']}, micro batch {m['micro_batch']} x {m['mbs']}; "
        f"{warmup} warm-up + {iters} timed iterations",
        f"mfu_bf16_equiv: FLOPs of megatron/core/transformer/flops.py per second / the dense bf16 peak ({peak[1]})",
        "ours-blockwise multiplies in the fp32 emulation on every device (docs/fp8.md): its speed is not FP8's",
    ]
    check_fp8_layer(report, ctx)


def check_fp8_layer(report, ctx) -> None:
    """One fc1-sized product y = x W^T from the same e4m3 operands, tensorwise scales: emulated vs _scaled_mm."""
    section = report.section(
        "fp8_layer",
        "One layer's FP8 product: emulation vs torch._scaled_mm",
        [
            "layer",
            "tokens",
            "in",
            "out",
            "emulated vs bf16 rel err",
            "_scaled_mm vs emulated max abs",
            "rel err",
            "error",
        ],
    )
    m = shape(ctx.dry_run)
    tokens, k, n = m["seq"], m["hidden"], 2 * m["ffn"]
    generator = torch.Generator(device=ctx.device).manual_seed(0)
    x = torch.randn(tokens, k, device=ctx.device, generator=generator).bfloat16()
    w = (torch.randn(n, k, device=ctx.device, generator=generator) * 0.02).bfloat16()
    e4m3 = torch.float8_e4m3fn
    xs, ws = current_scale(amax(x), e4m3), current_scale(amax(w), e4m3)
    xq, wq = cast(x, xs, e4m3), cast(w, ws, e4m3)
    emulated = emulated_mm(xq, xs.reciprocal(), wq, ws.reciprocal(), torch.float32)
    exact = x.float() @ w.float().t()
    row = {
        "layer": "linear_fc1 (gate and up)",
        "tokens": tokens,
        "in": k,
        "out": n,
        "emulated vs bf16 rel err": ((emulated - exact).norm() / exact.norm()),
    }
    row["emulated vs bf16 rel err"] = row["emulated vs bf16 rel err"].item()
    if not device_has_fp8(ctx.device):
        reason = NA if ctx.dry_run else "this GPU has no FP8 (compute capability < 8.9)"
        section.add(**row, **{"_scaled_mm vs emulated max abs": reason, "rel err": reason})
        return
    try:
        scaled = torch._scaled_mm(xq, wq.t(), scale_a=xs.reciprocal(), scale_b=ws.reciprocal(), out_dtype=torch.float32)
        diff = (scaled - emulated).abs()
        section.add(
            **row,
            **{"_scaled_mm vs emulated max abs": diff.max().item(), "rel err": (diff.norm() / emulated.norm()).item()},
        )
    except RuntimeError as error:
        section.add(**row, error=error_line(error))
    section.notes.append("same FP8 values and scales; the two differ only in accumulation order and where scales apply")
