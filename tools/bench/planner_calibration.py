#!/usr/bin/env python
"""The step-time model against published training runs, and the time to plan a 1,000-layout search.

    python tools/bench/planner_calibration.py          # the table; last line: the calibration summary
    python tools/bench/planner_calibration.py --fit    # re-fit the constants of compute_cost.Calibration

For every run of tools/bench/published_runs.py: the predicted and published TFLOP/s per GPU
(the metric its source reports: hardware for SC21, model for Megatron-Core), the error, the
predicted step time and whether the memory estimate fits the layout in the device's memory.
Rows whose micro batch and virtual stages were not published take the planner's fastest
layout that fits (the planner picks them as it would for a user).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.planning.budget import GIB  # noqa: E402
from megatron.planning.compute_cost import Calibration  # noqa: E402
from megatron.planning.estimator import estimate_memory  # noqa: E402
from megatron.planning.hardware import DEVICES  # noqa: E402
from megatron.planning.planner import Search, enumerate_layouts, plan  # noqa: E402
from megatron.planning.step_time import DEFAULT_CALIBRATION, Overlap, Practice, Projection  # noqa: E402
from megatron.training.arguments.tool_command_line import run_config_for_tool  # noqa: E402
from megatron.training.memory_check import layout_from_run  # noqa: E402
from tools.bench.published_fp8_runs import FP8_RUNS  # noqa: E402
from tools.bench.published_runs import ALL_RUNS, RUNS  # noqa: E402

PROG = "tools/bench/planner_calibration.py"
# every published row: BF16 dense and MoE (published_runs.py), FP8 (published_fp8_runs.py)
EVERY_RUN = ALL_RUNS + FP8_RUNS


@dataclasses.dataclass(frozen=True)
class Outcome:
    run: object
    layout: object
    time: object
    fits: bool
    certain_fits: bool
    total_gib: float

    @property
    def predicted(self) -> float:
        """The prediction in the published metric's unit."""
        t = self.time
        return {
            "hardware": t.hardware_tflops_per_gpu,
            "model": t.model_tflops_per_gpu,
            "step_s": t.total_s,
            "tokens_per_gpu": t.tokens_per_s / t.world_size,
        }[self.run.metric]

    @property
    def error(self) -> float:
        """Predicted / published throughput - 1 (for step seconds: published / predicted - 1)."""
        if self.run.metric == "step_s":
            return self.run.published / self.predicted - 1
        return self.predicted / self.run.published - 1


def projection_for(run, cal: Calibration) -> Projection:
    return Projection(
        hw=DEVICES[run.device],
        cal=cal,
        overlap=Overlap(grad_reduce=run.overlap_grad_reduce, param_gather=run.overlap_param_gather),
        attention=run.attention,
        practice=Practice(cp_all_gather=run.cp_all_gather, regather_params=run.regather_params),
    )


def run_layouts(run) -> list[tuple[object, object]]:
    """(config, layout) of the run's own layout, or of every layout the planner would consider for it
    when the source leaves micro batch and virtual stages open."""
    flags = list(run.flags) + (["--micro-batch-size", "1"] if run.searched else [])
    config = run_config_for_tool(flags, run.family, run.num_gpus, PROG)
    if not run.searched:
        layout = layout_from_run(config, "cuda").with_ddp(grad_dtype=run.grad_dtype)
        if run.interleave:
            layout = dataclasses.replace(
                layout, parallel=dataclasses.replace(layout.parallel, virtual_stages=run.interleave)
            )
        return [(config.model, layout)]
    par = config.parallel
    search = Search(
        tps=(par.tp,),
        cps=(1,),
        pps=(par.pp,),
        micro_batch_sizes=(1, 2, 4),
        recompute=("none",),
        distributed_optimizer=(True,),
        stage_splits=((None, None),),
        grad_dtype=run.grad_dtype,
        max_virtual_stages=config.model.num_layers,
        schedules=("1f1b", "interleaved"),  # Megatron-LM's: the published runs had no zero-bubble schedule
    )
    batch = config.training.global_batch_size
    return [
        (cfg, lay) for cfg, lay, _ in enumerate_layouts(config.model, run.num_gpus, batch, search, DEVICES[run.device])
    ]


@functools.cache
def candidates(run) -> tuple[tuple[object, object, bool, bool, float], ...]:
    """(config, layout, fit verdict "fits" (fit_rule.py), not refused, GiB) of each of `run_layouts(run)`
    (memory does not depend on the constants, so a fit estimates it once)."""
    device_bytes = int(DEVICES[run.device].memory_gib * GIB)
    out = []
    for cfg, layout in run_layouts(run):
        if run.interleave:  # a layout our trainer cannot build: not estimated
            out.append((cfg, layout, None, None, float("nan")))
            continue
        estimate = estimate_memory(cfg, layout)
        out.append(
            (
                cfg,
                layout,
                estimate.fits(device_bytes),
                not estimate.would_refuse(device_bytes),
                estimate.max_total_bytes / GIB,
            )
        )
    return tuple(out)


def evaluate(run, cal: Calibration = DEFAULT_CALIBRATION) -> Outcome:
    """Predict one published run: its own layout, or the planner's pick (the fastest whose verdict is
    "fits") where the source leaves micro batch and virtual stages open."""
    projection = projection_for(run, cal)
    options = [c for c in candidates(run) if c[2]] if run.searched else candidates(run)
    if not options:
        raise ValueError(f"{run.name}: no layout fits")
    timed = [(projection(cfg, layout), cfg, layout, fits, certain, gib) for cfg, layout, fits, certain, gib in options]
    time, _, layout, fits, certain, gib = min(timed, key=lambda t: t[0].total_s)
    return Outcome(run, layout, time, fits, certain, gib)


def evaluate_all(cal: Calibration = DEFAULT_CALIBRATION, runs=RUNS) -> list[Outcome]:
    return [evaluate(run, cal) for run in runs]


def summary(outcomes: list[Outcome]) -> tuple[float, float]:
    errors = [abs(o.error) for o in outcomes]
    return sum(errors) / len(errors), max(errors)


def balanced_summary(outcomes: list[Outcome]) -> tuple[float, float]:
    """(mean over sources of each source's mean |error|, max |error|): every source counts once,
    however many rows it has (a weak-scaling series of near-identical rows would outweigh a paper
    of four)."""
    by_source: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_source.setdefault(o.run.source, []).append(o)
    means = [summary(rows)[0] for rows in by_source.values()]
    return sum(means) / len(means), summary(outcomes)[1]


GRID = {
    "gemm_peak_fraction": (0.65, 0.70, 0.75, 0.80, 0.85, 0.90),
    "flash_fraction": (0.2, 0.25, 0.3, 0.35, 0.45),
    "layer_overhead_s": (0.0, 2e-4, 4e-4, 6e-4),
    "step_overhead_s": (0.0, 0.05, 0.1, 0.15),
}
# fitted on the MoE rows alone, after GRID on the dense rows (`fit`)
MOE_GRID = {"expert_rows_half": (0.0, 256.0, 512.0, 1024.0, 1280.0, 1536.0, 2048.0, 4096.0)}
# fitted on the FP8 rows alone, after the others (`fit`)
FP8_GRID = {"fp8_gemm_peak_fraction": (0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9)}


# where a fit that should not inherit the fitted defaults starts (--holdout, --leave-one-source-out)
NEUTRAL = Calibration(
    gemm_peak_fraction=0.85, flash_fraction=0.35, layer_overhead_s=2e-4, step_overhead_s=0.1, expert_rows_half=256.0
)


def is_moe(run) -> bool:
    return "--num-experts" in run.flags


def is_fp8(run) -> bool:
    return "--fp8-format" in run.flags


def fit(start: Calibration = DEFAULT_CALIBRATION, passes: int = 2, runs=RUNS, verbose: bool = True) -> Calibration:
    """Coordinate descent over GRID on the dense BF16 rows of `runs`: each constant in turn takes the grid
    value with the smallest (mean |error|, max |error|) (the mean taken by source: `balanced_summary`),
    the others held; `passes` rounds. Then MOE_GRID on the MoE rows and FP8_GRID on the FP8 rows, the
    others held: neither constant moves a dense BF16 row, and their few rows do not move the dense constants."""
    best = _descend(start, passes, [run for run in runs if not is_moe(run) and not is_fp8(run)], GRID, verbose)
    best = _descend(best, 1, [run for run in runs if is_moe(run)], MOE_GRID, verbose)
    best = _descend(best, 1, [run for run in runs if is_fp8(run)], FP8_GRID, verbose)
    if verbose:
        print(f"fitted: {best}")
    return best


def _descend(start: Calibration, passes: int, runs, grid: dict, verbose: bool) -> Calibration:
    if not runs:
        return start
    best, score = start, balanced_summary(evaluate_all(start, runs))
    for _ in range(passes):
        for name, values in grid.items():
            for value in values:
                cal = dataclasses.replace(best, **{name: value})
                trial = balanced_summary(evaluate_all(cal, runs))
                if verbose:
                    print(f"  {name} = {value:g}: mean {100 * trial[0]:.2f}% max {100 * trial[1]:.2f}%", flush=True)
                if trial < score:
                    best, score = cal, trial
    if verbose:
        print(f"  best: mean {100 * score[0]:.2f}%, max {100 * score[1]:.2f}% over {len(runs)} rows")
    return best


def _short_source(source: str) -> str:
    return source.split(" (")[0].split(",")[0].split(":")[0]


def leave_one_source_out(
    runs=EVERY_RUN, start: Calibration = NEUTRAL, passes: int = 2, held_out: tuple[str, ...] = ()
) -> list[tuple[str, object]]:
    """For each source of `runs` (those whose short name contains one of `held_out`, when given): fit the
    constants (`fit` from `start`) on the other sources' rows, predict the source's own rows. Returns (source,
    fitted Calibration, held-out outcomes) per source."""
    folds = []
    sources = dict.fromkeys(run.source for run in runs)
    for source in [s for s in sources if not held_out or any(name in _short_source(s) for name in held_out)]:
        held = [run for run in runs if run.source == source]
        fitted = fit(start, passes, [run for run in runs if run.source != source], verbose=False)
        folds.append((source, fitted, evaluate_all(fitted, held)))
        mean, worst = summary(folds[-1][2])
        print(
            f"  {_short_source(source)}: fitted on the other sources {_constants_text(fitted)}; "
            f"held out: mean {100 * mean:.1f}%, max {100 * worst:.1f}%",
            flush=True,
        )
    return folds


def _constants_text(cal: Calibration) -> str:
    return (
        f"(gemm {cal.gemm_peak_fraction:g}, flash {cal.flash_fraction:g}, "
        f"layer {1e3 * cal.layer_overhead_s:g} ms, step {cal.step_overhead_s:g} s, "
        f"expert rows r0 {cal.expert_rows_half:g}, fp8 gemm {cal.fp8_gemm_peak_fraction:g})"
    )


def print_folds(folds, markdown: bool = False) -> None:
    """Per held-out row, then per source (mean and max |error|) and over all held-out rows."""
    every = [o for _, _, outcomes in folds for o in outcomes]
    (print_markdown if markdown else print_table)(every)
    print()
    if markdown:
        print("| held-out source | rows | GPU | mean abs error | max abs error | constants fitted on the others |")
        print("|---|---|---|---|---|---|")
    for source, fitted, outcomes in folds:
        mean, worst = summary(outcomes)
        devices = "/".join(sorted({o.run.device.split("-")[0].upper() for o in outcomes}))
        if markdown:
            print(
                f"| {_short_source(source)} | {len(outcomes)} | {devices} | {100 * mean:.1f}% | {100 * worst:.1f}% | "
                f"{_constants_text(fitted)[1:-1]} |"
            )
        else:
            print(
                f"{_short_source(source):<40} {len(outcomes):3d} rows {devices:<5} mean |error| {100 * mean:5.1f}%  "
                f"max {100 * worst:5.1f}%  {_constants_text(fitted)}"
            )
    mean, worst = summary(every)
    by_source = sum(summary(outcomes)[0] for _, _, outcomes in folds) / len(folds)
    print(
        f"leave-one-source-out: mean |error| {100 * mean:.1f}% over {len(every)} held-out rows "
        f"({100 * by_source:.1f}% averaged by source), max {100 * worst:.1f}%"
    )


def _layout_text(lay) -> str:
    par = lay.parallel
    cp = f" c{par.cp}" if par.cp > 1 else ""
    return f"t{par.tp}{cp} p{par.pp} d{par.dp} v{par.virtual_stages} mbs{lay.micro_batch_size} m{lay.num_microbatches}"


def _fits_text(fits) -> str:
    return "n/a" if fits is None else "yes" if fits else "no"


def print_table(outcomes: list[Outcome]) -> None:
    print(
        f"{'run':<30} {'layout':<34} {'metric':<8} {'published':>9} {'predicted':>9} {'error':>7} "
        f"{'step s':>7} {'bubble':>6} {'mem GiB':>8} {'fits':>4}"
    )
    for o in outcomes:
        print(
            f"{o.run.name:<30} {_layout_text(o.layout):<34} {o.run.metric:<8} {o.run.published:9.2f} "
            f"{o.predicted:9.2f} {100 * o.error:+6.1f}% {o.time.total_s:7.2f} {100 * o.time.bubble_fraction:5.1f}% "
            f"{o.total_gib:8.1f} {_fits_text(o.fits):>4}"
        )


def print_markdown(outcomes: list[Outcome]) -> None:
    """The table as docs/planner.md shows it."""
    print("| run | layout | metric | published | predicted | error | step s | bubble | mem GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for o in outcomes:
        print(
            f"| {o.run.name} | {_layout_text(o.layout)} | {o.run.metric} | {o.run.published:.2f} | {o.predicted:.2f} | "
            f"{100 * o.error:+.1f}% | {o.time.total_s:.2f} | {100 * o.time.bubble_fraction:.1f}% | "
            f"{'n/a' if o.fits is None else f'{o.total_gib:.1f}'} |"
        )


def time_search() -> tuple[int, float]:
    """Plan a Llama-2-70B-like model on 512 H100s: over a thousand layouts estimated, those that fit
    projected. Returns (layouts, fitting, wall seconds, CPU seconds)."""
    config = run_config_for_tool(
        [
            "--num-layers",
            "80",
            "--hidden-size",
            "8192",
            "--ffn-hidden-size",
            "28672",
            "--num-attention-heads",
            "64",
            "--group-query-attention",
            "--num-query-groups",
            "8",
            "--seq-length",
            "4096",
            "--vocab-size",
            "32000",
            "--bf16",
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "1024",
        ],
        "llama",
        512,
        PROG,
    )
    search = Search(micro_batch_sizes=(1, 2), cps=(1, 2), max_virtual_stages=4)
    start, cpu = time.perf_counter(), time.process_time()
    fitting, rejected, _ = plan(
        config.model,
        512,
        1024,
        int(DEVICES["h100-80gb"].memory_gib * GIB),
        search=search,
        projection=Projection(hw=DEVICES["h100-80gb"]),
    )
    return len(fitting) + rejected, len(fitting), time.perf_counter() - start, time.process_time() - cpu


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="grid-search the fitted constants first")
    parser.add_argument(
        "--holdout",
        action="store_true",
        help="also fit on every other run (from a neutral start) and report the error on the rest",
    )
    parser.add_argument(
        "--leave-one-source-out",
        action="store_true",
        help="for each source of every published run (tools/bench/published_runs.py ALL_RUNS and "
        "published_fp8_runs.py FP8_RUNS): fit the constants "
        "on the other sources (from a neutral start) and report the error on the source left out",
    )
    parser.add_argument(
        "--held-out",
        nargs="+",
        default=(),
        metavar="NAME",
        help="with --leave-one-source-out: hold out only the sources whose short name contains NAME (e.g. "
        "'MoE' 'Automodel': the MoE folds alone; 'FP8': the FP8 folds alone; about 1 min each instead of the "
        "whole run)",
    )
    parser.add_argument("--passes", type=int, default=2, help="coordinate-descent passes of each fit (default 2)")
    parser.add_argument(
        "--all", action="store_true", help="the table (and --fit) over every published run, not the calibration set"
    )
    parser.add_argument("--no-search-timing", action="store_true", help="skip timing the 1,000-layout search")
    parser.add_argument("--markdown", action="store_true", help="print the table in markdown (docs/planner.md)")
    args = parser.parse_args(argv)
    runs = EVERY_RUN if args.all else RUNS
    if args.leave_one_source_out:
        sources = len({run.source for run in EVERY_RUN})
        print(f"leave-one-source-out over {sources} sources, {len(EVERY_RUN)} rows ({args.passes} passes per fit):")
        print_folds(leave_one_source_out(passes=args.passes, held_out=tuple(args.held_out)), markdown=args.markdown)
        return 0
    cal = fit(passes=args.passes, runs=runs) if args.fit else Calibration()
    outcomes = evaluate_all(cal, runs)
    (print_markdown if args.markdown else print_table)(outcomes)
    if not args.no_search_timing:
        count, fitting, seconds, cpu = time_search()
        print(
            f"planning a search of {count} layouts (Llama-2-70B shape, 512 H100s; all estimated, the {fitting} "
            f"that fit projected): {seconds:.1f} s wall, {cpu:.1f} s CPU, {1e3 * cpu / count:.1f} ms CPU per layout"
        )
    if args.holdout:
        half = fit(NEUTRAL, runs=RUNS[0::2])
        mean, worst = summary(evaluate_all(half, RUNS[1::2]))
        print(
            f"held out: fitted on {len(RUNS[0::2])} runs (every other), on the other {len(RUNS[1::2])}: "
            f"mean |error| {100 * mean:.1f}%, max {100 * worst:.1f}%"
        )
    mean, worst = summary(outcomes)
    label = "all published runs" if args.all else "calibration"
    print(f"{label}: mean |error| {100 * mean:.1f}%, max {100 * worst:.1f}% over {len(outcomes)} published runs")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
