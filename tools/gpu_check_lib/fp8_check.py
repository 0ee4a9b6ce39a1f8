"""Part fp8: our BF16 step and each FP8 recipe at the 8B layer shape, beside torchtitan with torchao float8
(tensorwise, rowwise), one layer's emulated FP8 products beside torch._scaled_mm's, and where a linear
layer's time goes (fp8_ops.py).

Section `fp8` has the rows the issue names (`ours-bf16`, `ours-tensorwise`, `ours-delayed`, `ours-blockwise`,
`torchtitan-bf16`, `torchtitan-tensorwise`, `torchtitan-rowwise`) with `tokens_per_s`, `speedup_vs_bf16`
(over our BF16 step), `mfu_bf16_equiv` (the model's FLOPs per second over the dense BF16 peak: FP8 counted as
BF16 work) and `final_loss` (after the timed steps). The shape is the throughput part's (throughput_jobs.py
`SHAPE`, seq 8192) with 2 layers and 2 microbatches. torchtitan's rows are the throughput part's torchtitan
jobs (torchtitan_rows.py: torchtitan 0.2.2's own Trainer, our custom import, compiled as torchtitan runs
float8) with torchtitan's float8 converter (torchao's `tensorwise` / `rowwise` recipe, the output layer
left out, as torchtitan's docs do), each in a fresh process; where torchtitan or torchao does not import,
their rows say why. Section `fp8_layer` compares one linear layer's products from the same FP8 operands: our
fp32 emulation against torch._scaled_mm, per-tensor and block-scaled. Section `fp8_ops` (fp8_ops.py):
the GEMM alone vs each quantisation alone, torch ops vs the fused Triton kernels.
"""

from __future__ import annotations

import torch

from kernels.fp8_blocks import quantize_blocks
from megatron.core.fp8.gemm import block_mm, device_has_block_scaled_mm, device_has_fp8, emulated_mm, expand_blocks
from megatron.core.fp8.recipe import BLOCK
from megatron.core.fp8.scaling import amax, cast, current_scale
from megatron.core.transformer.flops import flops_per_iteration
from tools.gpu_check_lib.fp8_ops import check_fp8_ops
from tools.gpu_check_lib.report import NA
from tools.gpu_check_lib.runs import error_line, free_device_memory, run_config, train
from tools.gpu_check_lib.throughput_jobs import DRY_SHAPE, SHAPE, Job

# Llama-3.1-8B's layer (the throughput part's shape), two layers and two microbatches so that a run fits the budget
RUN = dict(layers=2, micro_batch=1, mbs=2)
REAL, DRY = {**SHAPE, **RUN}, {**DRY_SHAPE, **RUN}
REAL_ITERS, DRY_ITERS = (2, 6), (1, 2)  # (warm-up, timed)
RECIPES = {
    "ours-bf16": [],
    "ours-tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "ours-delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
    "ours-blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
}
TORCHTITAN = {"torchtitan-bf16": None, "torchtitan-tensorwise": "tensorwise", "torchtitan-rowwise": "rowwise"}
TORCHTITAN_NEED_S = 100  # a fresh process, torch.compile of two layers, 8 steps
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


def torchtitan_float8_argv(recipe: str | None) -> list[str]:
    """torchtitan 0.2.2's flags for torchao float8 training with `recipe` (None: bf16): its converter, the
    recipe by name, the output layer left in bf16 (as ours keeps the LM head)."""
    if recipe is None:
        return []
    converter = ["--model.converters", "quantize.linear.float8"]
    return converter + [
        "--quantize.linear.float8.recipe_name",
        recipe,
        "--quantize.linear.float8.filter_fqns",
        "output",
    ]


def torchtitan_job(ctx, recipe: str | None, torchtitan_path) -> Job:
    """The throughput part's torchtitan job (torchtitan_rows.py) at this part's layers, batch and iterations."""
    warmup, iters = DRY_ITERS if ctx.dry_run else REAL_ITERS
    return Job(
        "torchtitan",
        ctx.dry_run,
        RUN["layers"],
        micro_batch=RUN["micro_batch"],
        microbatches=RUN["mbs"],
        warmup=warmup,
        iters=iters,
        extra_argv=torchtitan_float8_argv(recipe),
        compile=True,
        torchtitan_path=torchtitan_path,
    )


def _torchtitan_rows(section, ctx, tokens, flops, peak, bf16_step) -> str:
    """torchtitan's three rows, each a fresh process (in this one on a dry run); returns where torchtitan came from."""
    from tools.gpu_check_lib.throughput_check import runner
    from tools.gpu_check_lib.torchtitan_rows import torchtitan_source

    torchtitan_path, source = torchtitan_source()
    run = runner(ctx)
    for name, recipe in TORCHTITAN.items():
        result = run(torchtitan_job(ctx, recipe, torchtitan_path), TORCHTITAN_NEED_S)
        step = result["step_s"] if result["error"] is None else None
        cells = _row(name, step if isinstance(step, float) else None, result["losses"], tokens, flops, peak, bf16_step)
        if not isinstance(step, float):
            why = result["error"] or result.get("note") or NA
            cells.update(tokens_per_s=why, speedup_vs_bf16=why, mfu_bf16_equiv=why)
        section.add(**cells, error=result["error"])
    return source


def check_fp8(report, ctx, peak) -> None:
    """`peak`: (dense bf16 TFLOP/s or None, what it is). The part's budget: parts.py (torchtitan's rows run last
    and are skipped when it is spent)."""
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
    check_fp8_layer(report, ctx)
    check_fp8_ops(report, ctx, m)
    free_device_memory(ctx)
    source = _torchtitan_rows(section, ctx, tokens, flops, peak, bf16_step)
    section.notes += [
        f"shape: {m['layers']} layers of hidden {m['hidden']}, ffn {m['ffn']}, {m['heads']} heads / {m['groups']} "
        f"groups, seq {m['seq']}, vocab {m['vocab']}, micro batch {m['micro_batch']} x {m['mbs']}; "
        f"{warmup} warm-up + {iters} timed iterations",
        f"mfu_bf16_equiv: FLOPs of megatron/core/transformer/flops.py per second / the dense bf16 peak ({peak[1]})",
        "ours-blockwise: torch._scaled_mm with block scales where the device has them (Hopper, CUDA >= 12.9) and "
        "a layer's blocks are whole, else the fp32 emulation (docs/fp8.md)",
        f"torchtitan: {source}; its Trainer compiled (torch.compile), torchao float8 through its converter; "
        "speedup_vs_bf16 is over our BF16 row",
    ]


LAYER_COLUMNS = ["layer", "scales", "tokens", "in", "out", "emulated vs bf16 rel err", "_scaled_mm vs emulated max abs",
                 "rel err", "error"]  # fmt: skip


def _per_tensor(x, w):
    """(emulated product, _scaled_mm of the same operands or None where the device has no FP8): tensorwise e4m3."""
    e4m3 = torch.float8_e4m3fn
    xs, ws = current_scale(amax(x), e4m3), current_scale(amax(w), e4m3)
    xq, wq = cast(x, xs, e4m3), cast(w, ws, e4m3)
    emulated = emulated_mm(xq, xs.reciprocal(), wq, ws.reciprocal(), torch.float32)
    if not device_has_fp8(x.device):
        return emulated, None
    scaled = torch._scaled_mm(xq, wq.t(), scale_a=xs.reciprocal(), scale_b=ws.reciprocal(), out_dtype=torch.float32)
    return emulated, scaled


def _blocks(x, w):
    """The same for 1x128 input and 128x128 weight blocks (bf16 output: cuBLAS's block scaling gives no fp32)."""
    e4m3 = torch.float8_e4m3fn
    xq, _, x_inv = quantize_blocks(x, 1, e4m3, "torch")
    wq, _, w_inv = quantize_blocks(w, BLOCK, e4m3, "torch")
    emulated = emulated_mm(
        xq, expand_blocks(x_inv, 1, xq.shape), wq, expand_blocks(w_inv, BLOCK, wq.shape), torch.bfloat16
    ).float()
    if not device_has_block_scaled_mm(x.device):
        return emulated, None
    return emulated, block_mm(xq, x_inv, wq, w_inv, BLOCK, torch.bfloat16).float()


def check_fp8_layer(report, ctx) -> None:
    """One fc1-sized product y = x W^T from the same e4m3 operands, per-tensor and block scales: emulated vs
    torch._scaled_mm."""
    section = report.section("fp8_layer", "One layer's FP8 product: emulation vs torch._scaled_mm", LAYER_COLUMNS)
    m = shape(ctx.dry_run)
    tokens, k, n = m["seq"], m["hidden"], 2 * m["ffn"]
    generator = torch.Generator(device=ctx.device).manual_seed(0)
    x = torch.randn(tokens, k, device=ctx.device, generator=generator).bfloat16()
    w = (torch.randn(n, k, device=ctx.device, generator=generator) * 0.02).bfloat16()
    exact = x.float() @ w.float().t()
    for scales, product, missing in (
        ("per tensor", _per_tensor, "this GPU has no FP8 (compute capability < 8.9)"),
        (
            "1x128 / 128x128 blocks",
            _blocks,
            "no block-scaled _scaled_mm here (needs compute capability 9.0, CUDA >= 12.9)",
        ),
    ):
        row = dict(layer="linear_fc1 (gate and up)", scales=scales, tokens=tokens, out=n, **{"in": k})
        try:
            emulated, scaled = product(x, w)
        except RuntimeError as error:
            section.add(**row, error=error_line(error))
            continue
        row["emulated vs bf16 rel err"] = ((emulated - exact).norm() / exact.norm()).item()
        if scaled is None:
            reason = NA if ctx.dry_run else missing
            section.add(**row, **{"_scaled_mm vs emulated max abs": reason, "rel err": reason})
            continue
        diff = (scaled - emulated).abs()
        section.add(
            **row,
            **{"_scaled_mm vs emulated max abs": diff.max().item(), "rel err": (diff.norm() / emulated.norm()).item()},
        )
    section.notes.append("same FP8 values and scales; the two differ only in accumulation order and where scales apply")
