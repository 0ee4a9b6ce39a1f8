"""Part throughput (issue 43): training speed at the Llama-3-8B layer shape (hidden 4096, ffn 14336, 32 heads, 8
K/V groups, seq 8192, bf16, vocabulary 128256) with 8 layers, and 16 where memory allows (the time per layer by
difference), micro batch 1, 8 microbatches, synthetic tokens; ours beside bare PyTorch and torchtitan.

Sections, in this order within the part's budget (a run that would not fit the time left is a row saying so):
1. attention_backends.py: our flash kernel vs each SDPA backend at the check's attention shape (in this
   process); its fastest correct SDPA backend is the one the bare rows pin.
2. the rows (`ROWS`), each run in a fresh process one after another (throughput_jobs.py): ours with its default
   flags and with `BEST_FLAGS`, bare PyTorch eager and under torch.compile (bare_llama.py), torchtitan 0.2.2
   eager and compiled (torchtitan_rows.py), at 8 layers;
3. memory_limit.py: four configurations on both sides of the device's memory;
4. the same rows at 16 layers (ours where the start-up check lets it start), as the time left allows.
Columns (`COLUMNS`, named as issue 43 asks; a number where measured, else a string saying why): tokens/s;
model TFLOP/s with attention counted as Megatron counts it (12 L d s per token: the full s x s, the log line's
megatron/core/transformer/flops.py) and its MFU; MFU with causal attention counted (half the s x s);
ms per layer (the 16-layer step time less the 8-layer one, over 8 layers, per iteration); the allocator's
peak; the step time; for ours, the planner's projection of the same run (megatron/planning/step_time.py on
the device's preset); the loss after the timed steps.
"""

from __future__ import annotations

import time

from tools.gpu_check_lib.report import NA, gib
from tools.gpu_check_lib.throughput_jobs import Job, run_job

COLUMNS = ["name", "layers", "tokens_per_s", "tflops_12lds", "mfu_12lds", "mfu_causal", "ms_per_layer",
           "peak_allocated_gib", "step_s", "projected_step_s", "final_loss"]  # fmt: skip
# flags of ours-best beside the defaults: the fused LM head + cross-entropy (gradients in its forward, 3 GEMMs)
# and the weight gradients of bf16 weights accumulated into fp32 main_grad inside the GEMM
BEST_FLAGS = ["--cross-entropy-loss-fusion", "--gradient-accumulation-fusion"]
ROWS = (  # name, job kind, job fields; run in this order, back to back, before anything else at 8 layers
    ("ours", "ours", {}),
    ("ours-best", "ours", {"extra_argv": BEST_FLAGS}),
    ("bare-eager", "bare", {}),
    ("bare-compile", "bare", {"compile": True}),
    ("torchtitan-eager", "torchtitan", {}),
    ("torchtitan-compile", "torchtitan", {"compile": True}),
)
LAYERS, DRY_LAYERS = (8, 16), (1, 2)
ITERS, DRY_ITERS = (1, 2), (1, 1)  # (warm-up, timed): the first step of a compiled row compiles
# seconds a run is expected to take at 8 layers before it has run (a fresh process, the build, 3 steps of
# about 2 s; compiling adds its own); afterwards the 8-layer run's own wall time, x `MORE_LAYERS_S` at 16.
# Measured on an H200 (2026-11-28, docs/gpu-results/2026-11-28-h200.md, from the 16-layer needs): ours 19 s,
# ours-best 20 s, bare eager 36 s (its model then built on the host), bare compiled 42 s, torchtitan eager 21 s;
# torchtitan compiled was skipped (85 s asked for, 69 s left). A guess above what rows take skips them needlessly.
NEED_S = {"ours": 25, "bare": 30, "torchtitan": 25}
COMPILE_S = 20
MORE_LAYERS_S = 1.6
OURS_ONLY = "ours only: the planner models our trainer"


def _job(ctx, kind: str, layers: int, fields: dict, sdpa_backend, torchtitan_path) -> Job:
    warmup, iters = DRY_ITERS if ctx.dry_run else ITERS
    extra = dict(fields)
    if kind == "bare":
        extra["sdpa_backend"] = sdpa_backend
    if kind == "torchtitan":
        extra["torchtitan_path"] = torchtitan_path
    return Job(kind, ctx.dry_run, layers, warmup=warmup, iters=iters, **extra)


def runner(ctx):
    """run(job, need_s) -> result: the job in a fresh process (in this one on a dry run), given at most the
    part's time left; a job that would not fit is not started and its result says so."""

    def run(job: Job, need_s: float) -> dict:
        skipped = ctx.skip(need_s)
        if skipped:
            return dict(losses=[], step_s=None, max_allocated=None, error=skipped)
        return run_job(job, timeout_s=max(ctx.left(), 1.0), isolate=not ctx.dry_run)

    return run


def _need(kind: str, fields: dict, wall_s: float | None) -> float:
    """Seconds to reserve for a run: `wall_s` (the same row's run at fewer layers) x MORE_LAYERS_S, else a guess."""
    if wall_s is not None:
        return wall_s * MORE_LAYERS_S
    return NEED_S[kind] + (COMPILE_S if fields.get("compile") else 0)


def projected_step_s(ctx, job: Job, device_name: str | None) -> float:
    """The planner's step time of `job`'s run on the device's preset (the default preset on a dry run)."""
    import torch

    from megatron.planning.step_time import DEFAULT_HARDWARE, step_time
    from megatron.training.memory_check import layout_from_run
    from tools.gpu_check_lib.env import device_preset
    from tools.gpu_check_lib.runs import run_config

    hardware = DEFAULT_HARDWARE
    if device_name is not None:
        _, preset, _ = device_preset(device_name, torch.cuda.get_device_properties(ctx.device).total_memory)
        hardware = preset or hardware
    run = run_config(job.argv())
    return step_time(run.model, layout_from_run(run, "cuda"), hardware).total_s


def flops(job: Job) -> tuple[float, float, float]:
    """(model FLOPs of one iteration as the log line counts them: 12 L d s attention, the same with causal
    attention, the output layer's share) of `job`'s run."""
    from megatron.core.transformer.flops import flops_per_iteration
    from tools.gpu_check_lib.runs import run_config

    model = run_config(job.argv()).model
    batch = job.micro_batch * job.microbatches
    tokens = batch * model.seq_length
    full = flops_per_iteration(model, batch)
    half_attention = 6 * model.num_layers * model.seq_length * model.num_attention_heads * model.kv_channels * tokens
    return full, full - half_attention, 6 * model.hidden_size * model.padded_vocab_size * tokens / full


def row(name: str, job: Job, result: dict, peak_tflops, projected) -> dict:
    """The table's cells of one run from its job's result."""
    error, step = result["error"], result["step_s"]
    why = error or result.get("note") or (NA if job.dry_run else "not measured")
    measured = isinstance(step, float) and error is None
    full, causal, _ = flops(job)
    tokens = job.micro_batch * job.microbatches * job.shape["seq"]
    cells = dict(name=name, layers=job.layers, step_s=step if measured else why, ms_per_layer=why)
    cells["tokens_per_s"] = tokens / step if measured else why
    cells["tflops_12lds"] = full / step / 1e12 if measured else why
    no_peak = NA if job.dry_run else "no bf16 peak for this device (see the header)"
    for column, work in (("mfu_12lds", full), ("mfu_causal", causal)):
        cells[column] = (work / step / 1e12 / peak_tflops if peak_tflops else no_peak) if measured else why
    allocated = result["max_allocated"]
    cells["peak_allocated_gib"] = gib(allocated) if allocated is not None else why
    cells["final_loss"] = result["losses"][-1] if result["losses"] else why
    cells["projected_step_s"] = projected
    return cells


def per_layer(rows: list[dict], layers: tuple[int, int]) -> None:
    """Fill ms_per_layer of each name measured at both layer counts: (step 16 - step 8) / 8 layers."""
    few, many = layers
    for name in {r["name"] for r in rows}:
        pair = {r["layers"]: r for r in rows if r["name"] == name}
        steps = [pair.get(n, {}).get("step_s") for n in (few, many)]
        if all(isinstance(s, float) for s in steps):
            for r in pair.values():
                r["ms_per_layer"] = (steps[1] - steps[0]) / (many - few) * 1e3
        elif few in pair and isinstance(steps[0], float):
            pair[few]["ms_per_layer"] = f"needs the {many}-layer run: {pair.get(many, {}).get('step_s', 'not run')}"


def versus_best_peer(rows: list[dict], layers: int) -> str:
    """One line: ours and ours-best over the fastest peer (bare PyTorch, torchtitan) in tokens/s at `layers`,
    from rows of this run only (a missing figure: which row and why)."""
    measured = {r["name"]: r["tokens_per_s"] for r in rows if r["layers"] == layers}
    peers = {name: value for name, value in measured.items() if not name.startswith("ours")}
    timed = {name: value for name, value in peers.items() if isinstance(value, float)}
    if not timed:
        why = "; ".join(f"{name}: {value}" for name, value in peers.items()) or "no peer row"
        return f"ours / best peer at {layers} layers: no peer measured ({why})"
    best = max(timed, key=timed.get)
    parts = []
    for name in ("ours", "ours-best"):
        value = measured.get(name, "not run")
        ratio = f"{value / timed[best]:.3f}x" if isinstance(value, float) else f"not measured ({value})"
        parts.append(f"{name} {ratio}")
    missing = [name for name in peers if name not in timed]
    unmeasured = f"; peers not measured: {', '.join(missing)}" if missing else ""
    return (
        f"ours / best peer at {layers} layers, tokens/s in this run: {', '.join(parts)} of {best} "
        f"({timed[best]:,.1f}){unmeasured}"
    )


def _starts(ctx, job: Job) -> str | None:
    """None when the start-up check lets `job` start on this device, else its refusal (a dry run: None)."""
    if not ctx.cuda:
        return None
    import torch

    from tools.gpu_check_lib.env import estimate_run
    from tools.gpu_check_lib.runs import run_config

    total = torch.cuda.get_device_properties(ctx.device).total_memory
    estimate = estimate_run(run_config(job.argv()), ctx.device, total)
    return f"not run: the start-up check refuses it ({estimate.line[:160]})" if estimate.decision == "refuses" else None


def check_throughput(report, ctx) -> None:
    """The part's one section (tools/gpu_check_lib/parts.py); `ctx.peak`: (dense bf16 TFLOP/s or None, what it is)."""
    import torch

    from tools.gpu_check_lib import attention_backends, memory_limit
    from tools.gpu_check_lib.runs import error_line
    from tools.gpu_check_lib.torchtitan_rows import torchtitan_source

    sdpa_backend = attention_backends.check_attention(report, ctx)
    section = report.section("throughput", "Throughput at the Llama-3-8B layer shape: ours and its peers", COLUMNS)
    torchtitan_path, wheels = torchtitan_source()
    run, layers, peak = runner(ctx), DRY_LAYERS if ctx.dry_run else LAYERS, ctx.peak
    device_name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else None

    walls = {}  # name -> wall seconds of its run at layers[0]

    def add(name, kind, fields, count):
        job = _job(ctx, kind, count, fields, sdpa_backend, torchtitan_path)
        refused = _starts(ctx, job) if kind == "ours" and count > layers[0] else None
        begin = time.perf_counter()
        result = run(job, _need(kind, fields, walls.get(name))) if refused is None else dict(
            losses=[], step_s=None, max_allocated=None, error=refused
        )  # fmt: skip
        walls.setdefault(name, time.perf_counter() - begin)
        projected = OURS_ONLY
        if kind == "ours":
            try:
                projected = projected_step_s(ctx, job, device_name)
            except ValueError as error:  # a layout the step-time model does not cover
                projected = error_line(error)
        section.rows.append(row(name, job, result, peak[0], projected))

    for name, kind, fields in ROWS:
        add(name, kind, fields, layers[0])
    memory_limit.check_memory_limit(report, ctx, run, walls["ours"] * 2)
    for name, kind, fields in ROWS:
        add(name, kind, fields, layers[1])
    per_layer(section.rows, layers)
    probe = _job(ctx, "ours", layers[0], {}, None, None)
    section.notes += [
        versus_best_peer(section.rows, layers[0]),
        f"shape: {probe.shape}, micro batch {probe.micro_batch} x {probe.microbatches} microbatches, bf16, synthetic "
        f"tokens; warm-up + timed iterations {DRY_ITERS if ctx.dry_run else ITERS}; each row a fresh process",
        "tflops_12lds / mfu_12lds: attention counted as 12 L d s FLOPs per token (the full s x s, as Megatron and "
        "the NVIDIA recipe count it); mfu_causal: half of that attention; the output layer is "
        f"{flops(probe)[2]:.0%} of the FLOPs at {layers[0]} layers; MFU against {peak[1]}",
        f"ours-best: ours with {' '.join(BEST_FLAGS)}; bare rows pin SDPA to "
        f"{sdpa_backend or 'torch choice (no backend timed)'} (the attention section's fastest correct backend)",
        f"torchtitan: {wheels}; its own Trainer and Llama-3 with our custom import (torchtitan_custom.py)",
        "ms_per_layer: (16-layer step - 8-layer step) / 8 layers, per iteration; projected_step_s: the planner's "
        "step-time model for the same run on the device's preset (megatron/planning/step_time.py)",
    ]
