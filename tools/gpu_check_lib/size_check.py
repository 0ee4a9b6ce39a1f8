"""Part offload, 4: the largest Llama that fits this GPU and this host memory, trained for 3 iterations.

tools/bench/max_model_size.py's family (hidden h = 256, 384, ..., h / 128 layers, seq 2048,
micro batch 1, full recomputation, bf16) and its rule: a member fits when the estimator's
certain part plus the gathered buckets fit the device (its total memory) and its host bytes
the host (the start-up check's budget, MemAvailable, less 10% for the process itself).
Columns: full host residency (optim_grads_params with optimizer state, gradient and parameter
shards all on host) and plain AdamW (no offload). Each column's largest member is found by
bisection over the family (device and host bytes grow with h), then trained: 1 warm-up + 2
timed iterations, each in a fresh process (this interpreter, `python -m
tools.gpu_check_lib.size_check SPEC`), so a row measures that member alone: nothing an earlier
member or section left behind, inside or outside PyTorch's allocator, is on the device (the
H200 run's no-offload member ran out of memory with 41 GiB held outside the allocator by the
member before it); `held elsewhere GiB` is what the device had in use when the member's process
started (this process's CUDA context and whatever it could not free). Dry run: the first three
members, seq 64, and a device budget 5% above the smallest no-offload member's (so the search has
something to decide); no host limit there; the members run in fresh processes too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tools.gpu_check_lib.env import estimate_run, host_budget, size_rule
from tools.gpu_check_lib.report import GIB, NA
from tools.gpu_check_lib.runs import Context, free_device_memory, run_config, start_process_group, train

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # the child picks its own
DRY_RUN_TIMEOUT_S = 300.0

HOST_SHARE = 0.9  # of MemAvailable: the process itself needs host memory too (a host OOM kills the check)
COLUMNS = (("host resident", 200), ("plain AdamW", 90))  # the rule's column, seconds a GPU run may need


def _member(rule, column: str, width: int, seq: int):
    spec = rule.COLUMNS[column]
    argv = rule.member_argv(width, 1, True, spec.flags, spec.fixed, seq_length=seq) + ["--mock-data"]
    return argv + ["--train-iters", "3"]


def largest(ctx, rule, column: str, widths, seq: int, budget: float, host: int | None):
    """(width, argv, estimate) of the column's largest member that fits, or None."""

    def fit(width):
        argv = _member(rule, column, width, seq)
        estimate = estimate_run(run_config(argv), ctx.device, None)
        ok = rule.device_bytes(estimate.rank) <= budget and (host is None or estimate.host <= host)
        return ok, (width, argv, estimate)

    low, high, best = 0, len(widths) - 1, None  # widths[low - 1] fits; widths[high + 1] does not
    while low <= high:
        middle = (low + high) // 2
        ok, found = fit(widths[middle])
        if ok:
            best, low = found, middle + 1
        else:
            high = middle - 1
    return best


def check_size(report, ctx) -> None:
    section = report.section(
        "size_fits",
        "Largest Llama that fits (max_model_size.py's rule), trained 3 iterations",
        ["column", "hidden", "layers", "parameters", "estimate device GiB", "estimate total GiB", "estimate host GiB",
         "ran", "held elsewhere GiB", "device peak GiB", "peak / estimate device", "tokens/s"],
    )  # fmt: skip
    rule = size_rule()
    widths, seq = (rule.WIDTHS[:3], 64) if ctx.dry_run else (rule.WIDTHS, 2048)
    if ctx.cuda:
        budget = float(torch.cuda.get_device_properties(ctx.device).total_memory)
        host = int(HOST_SHARE * host_budget(ctx.device))
    else:
        smallest = estimate_run(run_config(_member(rule, "plain AdamW", widths[0], seq)), ctx.device, None)
        budget, host = 1.05 * rule.device_bytes(smallest.rank), None
    sizes, pids = {}, []
    for column, need_s in COLUMNS:
        found = largest(ctx, rule, column, widths, seq, budget, host)
        if found is None:
            section.add(column=column, ran="none fits")
            continue
        width, argv, estimate = found
        sizes[column] = estimate.rank.parameters
        row = dict(column=column, hidden=width, layers=max(2, width // 128), parameters=estimate.rank.parameters)
        row.update({"estimate device GiB": rule.device_bytes(estimate.rank) / GIB})
        row.update({"estimate total GiB": estimate.total / GIB, "estimate host GiB": estimate.host / GIB})
        skipped = ctx.skip(need_s)
        if skipped:
            section.add(**row, ran=skipped)
            continue
        measured = run_member(ctx, argv, DRY_RUN_TIMEOUT_S if ctx.dry_run else max(ctx.left(), need_s))
        peak, held = measured.get("max_allocated"), measured.get("held_elsewhere", NA)
        pids += [measured["pid"]] if "pid" in measured else []
        row["ran"] = "yes" if measured.get("error") is None else measured["error"]
        row["held elsewhere GiB"] = held / GIB if isinstance(held, int) else held
        row["device peak GiB"] = peak / GIB if isinstance(peak, int) else peak
        row["peak / estimate device"] = peak / rule.device_bytes(estimate.rank) if isinstance(peak, int) else peak
        step = measured.get("step_s")
        row["tokens/s"] = seq / step if isinstance(step, float) else (None if measured.get("error") else step)
        section.add(**row)
    device = f"{budget / GIB:.2f} GiB device" + (
        " (dry run: 5% above the smallest member; estimated for CPU, where host memory is the device's, so host "
        "residency frees no device bytes there)"
        if ctx.dry_run
        else ""
    )
    section.notes.append(
        f"budgets: {device}, host {'not limited' if host is None else f'{host / GIB:.1f} GiB (90% of MemAvailable)'}; "
        f"estimate device = certain part + gathered buckets (the rule's); total adds the unmeasured allowances"
    )
    if len(sizes) == 2:
        section.notes.append(
            f"host resident / plain AdamW parameters: {sizes['host resident'] / sizes['plain AdamW']:.2f}"
        )
    elif not ctx.dry_run:
        section.notes.append("size ratio: n/a (a column has no member that fits)")
    section.notes.append(
        f"each member ran in a fresh process: pids {', '.join(map(str, pids)) or '-'} (this one {os.getpid()})"
    )
    section.notes.append("tokens/s: " + ("n/a (dry run)" if ctx.dry_run else "2 timed iterations after 1 warm-up"))


def run_member(ctx, argv: list[str], timeout_s: float) -> dict:
    """Train one member (1 warm-up + 2 timed iterations) in a fresh process of this interpreter;
    runs.Measured's fields as a dict, plus `held_elsewhere`, or {"error": ...} when it did not report."""
    free_device_memory(ctx)  # this process's cached blocks go back before the member starts
    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "member.json"
        spec = json.dumps({"argv": argv, "dry_run": ctx.dry_run, "out": str(out)})
        command = [sys.executable, "-m", "tools.gpu_check_lib.size_check", spec]
        try:
            proc = subprocess.run(command, env=env, cwd=ROOT, timeout=timeout_s, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {"error": f"member process timed out after {timeout_s:.0f} s"}
        sys.stderr.write(proc.stdout + proc.stderr)  # the log keeps the member's output and tracebacks
        if not out.exists():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
            return {"error": f"member process exited with status {proc.returncode}: {last}"}
        return json.loads(out.read_text())


def _member_main(spec: dict) -> None:
    """The member process: train `spec["argv"]` alone on this process's device, write the result."""
    dry_run = spec["dry_run"]
    device = torch.device("cpu") if dry_run else torch.device("cuda", torch.cuda.current_device())
    held = NA
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        held = total - free
    start_process_group(device)
    measured = train(Context(device, dry_run, math.inf), spec["argv"], iters=2, warmup=1)
    result = dataclasses.asdict(measured) | {"held_elsewhere": held, "pid": os.getpid()}
    Path(spec["out"]).write_text(json.dumps(result, default=str))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _member_main(json.loads(sys.argv[1]))
