"""Part throughput, memory near the limit: our trainer at the check's shape (Llama-3-8B layers, seq 8192, full
vocabulary) in four configurations chosen on both sides of this device's memory, each run in a fresh process
whatever the start-up check says, and whether that check was right.

The configurations (`choose`): the start-up check's estimate (env.estimate_run, the one pretrain_llama.py
makes) of micro batch 1 without recomputation at 2, 4, 6, ... layers finds the most layers it lets start, L;
then L layers (start predicted, the closest from below), L + 2 (refusal predicted, the closest from above),
L + 2 with full recomputation (the same model made to fit) and L layers at micro batch 2. Each runs 2
iterations of one microbatch (the optimizer's state exists from the first step on; the second reaches the
peak). A dry run makes the same choice against a pretend device as large as the tiny model's estimate at 3
layers, so the choice and the rows are exercised; nothing can run out of memory on a CPU.

The outcomes are the first of our own trainer for the keep rule's data (tools/bench/fit_rule_outcomes.py):
`report_memory_runs` reads them back from a committed report.json as the fields of
tools/bench/published_memory_outcomes.py `MemoryRun`, which takes every report in docs/gpu-results/.
"""

from __future__ import annotations

import json
from pathlib import Path

from tools.gpu_check_lib.throughput_jobs import Job

SECTION = "memory_limit"
GIB = float(1 << 30)
RECOMPUTE = {
    "none": [],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
}
MICROBATCHES, WARMUP, ITERS = 1, 1, 1
COLUMNS = ["configuration", "layers", "micro batch", "recompute", "device GiB", "certain GiB", "total GiB",
           "start-up check", "ran", "max allocated GiB", "max reserved GiB", "check right"]  # fmt: skip


def job(dry_run: bool, layers: int, micro_batch: int, recompute: str) -> Job:
    return Job("ours", dry_run, layers, micro_batch, MICROBATCHES, WARMUP, ITERS, extra_argv=list(RECOMPUTE[recompute]))


def _decision(dry_run: bool, layers: int, micro_batch: int, recompute: str, device_bytes: int):
    import torch

    from tools.gpu_check_lib.env import estimate_run
    from tools.gpu_check_lib.runs import run_config

    run = run_config(job(dry_run, layers, micro_batch, recompute).argv())
    return estimate_run(run, torch.device("cuda"), device_bytes)  # the check as on the device, even on a dry run


def choose(dry_run: bool, device_bytes: int, step: int, most: int) -> list[tuple[int, int, str]]:
    """(layers, micro batch, recompute) of the four configurations; [] when even `step` layers are refused or
    `most` layers start."""
    fitting = None
    for layers in range(step, most + 1, step):
        if _decision(dry_run, layers, 1, "none", device_bytes).decision == "refuses":
            break
        fitting = layers
    else:
        return []
    if fitting is None:
        return []
    return [(fitting, 1, "none"), (fitting + step, 1, "none"), (fitting + step, 1, "full"), (fitting, 2, "none")]


def _device_bytes(ctx) -> tuple[int, str]:
    import torch

    if ctx.cuda:
        return torch.cuda.get_device_properties(ctx.device).total_memory, "the device's total memory"
    pretend = _decision(True, 3, 1, "none", 1 << 62).certain
    return pretend, "a pretend device: the tiny model's certain bytes at 3 layers (dry run)"


def check_memory_limit(report, ctx, run, need_s: float) -> None:
    """`run(job, need_s)`: the throughput part's job runner (a result dict, or a skip reason as its error);
    `need_s`: the seconds to reserve for each configuration."""
    import torch

    from tools.gpu_check_lib.report import NA, gib

    section = report.section(SECTION, "Memory near the device's limit (ours, the check's shape)", COLUMNS)
    device_bytes, what = _device_bytes(ctx)
    if ctx.cuda:
        free, _ = torch.cuda.mem_get_info(ctx.device)
        what += f" ({free / GIB:.1f} GiB free as the section starts: this process keeps its CUDA context)"
    configs = choose(ctx.dry_run, device_bytes, 1 if ctx.dry_run else 2, 8 if ctx.dry_run else 128)
    if not configs:
        section.notes.append("no configuration chosen: the estimate refuses the fewest layers or starts the most")
    for layers, micro_batch, recompute in configs:
        estimate = _decision(ctx.dry_run, layers, micro_batch, recompute, device_bytes)
        result = run(job(ctx.dry_run, layers, micro_batch, recompute), need_s)
        ran = "yes" if result["error"] is None else result["error"]
        right = NA if ctx.dry_run else "no outcome: it neither trained nor ran out of memory"
        if not ctx.dry_run and ran in ("yes", "out of memory"):
            right = (estimate.decision == "refuses") == (ran == "out of memory")
        section.add(
            configuration=f"L{layers} mbs{micro_batch} recompute {recompute}",
            layers=layers,
            recompute=recompute,
            ran=ran,
            **{"micro batch": micro_batch, "device GiB": device_bytes / GIB, "start-up check": estimate.decision},
            **{"certain GiB": estimate.certain / GIB, "total GiB": estimate.total / GIB, "check right": right},
            **{"max allocated GiB": gib(result["max_allocated"]), "max reserved GiB": gib(result.get("max_reserved"))},
        )
    section.notes += [
        f"device GiB: {what}; the start-up check (pretrain_llama.py's, env.estimate_run) refuses when the certain "
        "bytes exceed it and warns when only the total does; every configuration runs whatever it says "
        f"({MICROBATCHES} microbatches, {WARMUP + ITERS} iterations, a fresh process each)",
        "check right: a refusal that ran out of memory, or a start that trained; these rows feed "
        "tools/bench/published_memory_outcomes.py once this report is committed to docs/gpu-results/",
    ]


def report_memory_runs(path: Path) -> list[dict]:
    """The memory outcomes of one GPU check report.json as tools/bench/published_memory_outcomes.py `MemoryRun`
    fields: each configuration that trained or ran out of memory on a GPU (none from a dry run)."""
    data = json.loads(Path(path).read_text())
    section = data.get("sections", {}).get(SECTION)
    if section is None or data.get("meta", {}).get("dry run", True):
        return []
    device = data["meta"].get("device", "?")
    runs = []
    for row in section["rows"]:
        if row["ran"] not in ("yes", "out of memory"):
            continue
        max_allocated = row["max allocated GiB"]
        runs.append(
            dict(
                name=f"ours {row['configuration']}",
                source=f"the GPU check's memory_limit section on {device}, {Path(path).name}",
                num_gpus=1,
                device_memory_gib=row["device GiB"],
                flags=tuple(job(False, row["layers"], row["micro batch"], row["recompute"]).argv()),
                oom=row["ran"] == "out of memory",
                measured_gb=max_allocated * GIB / 1e9 if row["ran"] == "yes" and max_allocated is not None else None,
            )
        )
    return runs
