#!/usr/bin/env python
"""Layouts that ran, kept or dropped: the 80% rule before issue 36 against fit_rule.fit_verdict.

    python tools/bench/fit_rule_outcomes.py

Every layout here trained without running out of memory:

* the runs of tools/bench/published_runs.py (SC21 Table 1 on A100 80 GB, Megatron-Core r0.8 weak
  scaling on H100 80 GB). Megatron-Core does not publish micro batch and virtual stages, so for its
  rows every candidate the calibration considers (micro batch 1, 2, 4, every virtual-stage count)
  is counted, one of which ran: a row whose candidates are all dropped drops the run;
* `MEMORY_RUNS` of published_runs.py: Llama-3.1-8B on 8 x H100 94 GB.

Before: the estimate as it was (fragmentation 10% of the dynamic memory, runtime 1 GiB, no NCCL
buffers, no document mask), kept when its total is within 80% of the device (Fujii et al.'s rule).
After: the estimate with NCCL buffers per communicator, kept when fit_verdict says "fits". The
last line sums the layouts given in full and the runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.planning.budget import GIB  # noqa: E402
from megatron.planning.estimator import estimate_memory  # noqa: E402
from megatron.planning.fit_rule import fit_verdict  # noqa: E402
from megatron.planning.hardware import DEVICES  # noqa: E402
from megatron.planning.transients import CUDA_RUNTIME_BYTES, FRAGMENTATION_FRACTION, Allowances  # noqa: E402
from megatron.training.arguments.tool_command_line import run_config_for_tool  # noqa: E402
from megatron.training.memory_check import layout_from_run  # noqa: E402
from tools.bench.planner_calibration import run_layouts  # noqa: E402
from tools.bench.published_runs import MEMORY_RUNS, RUNS  # noqa: E402

PROG = "tools/bench/fit_rule_outcomes.py"
BEFORE = Allowances(FRAGMENTATION_FRACTION, CUDA_RUNTIME_BYTES)  # no NCCL buffers
FUJII_SHARE = 0.8


def kept(config, layout, device_bytes: int) -> tuple[bool, bool, float, str]:
    """(kept before, kept after, total GiB after, verdict after) of one layout."""
    before = estimate_memory(config, layout, allowances=BEFORE).max_total_bytes <= FUJII_SHARE * device_bytes
    verdict = fit_verdict(estimate_memory(config, layout), device_bytes)
    return before, verdict.fits, verdict.total_bytes / GIB, verdict.label


def rows():
    """(name, device GiB, layouts, kept before, kept after, detail) per run."""
    for run in RUNS:
        device_bytes = int(DEVICES[run.device].memory_gib * GIB)
        outcomes = [kept(cfg, lay, device_bytes) for cfg, lay in run_layouts(run)]
        detail = outcomes[0][3] if len(outcomes) == 1 else "candidates (mbs, v); one ran"
        yield run.name, device_bytes / GIB, outcomes, detail
    for run in MEMORY_RUNS:
        args = run_config_for_tool(list(run.flags), "llama", run.num_gpus, PROG)
        device_bytes = int(run.device_memory_gib * GIB)
        outcome = kept(args.model, layout_from_run(args, "cuda"), device_bytes)
        yield run.name, device_bytes / GIB, [outcome], f"{outcome[3]} ({outcome[2]:.2f} GiB)"


def main() -> int:
    print(f"{'run':<26} {'device GiB':>10} {'layouts':>7} {'kept before':>11} {'kept after':>10}  after")
    given = [0, 0, 0]  # layouts given in full: count, kept before, kept after
    runs = [0, 0, 0]  # runs: count, some candidate kept before, after
    for name, gib, outcomes, detail in rows():
        before, after = sum(o[0] for o in outcomes), sum(o[1] for o in outcomes)
        print(f"{name:<26} {gib:10.2f} {len(outcomes):7d} {before:11d} {after:10d}  {detail}")
        if len(outcomes) == 1:
            given = [given[0] + 1, given[1] + before, given[2] + after]
        runs = [runs[0] + 1, runs[1] + (before > 0), runs[2] + (after > 0)]
    print(
        f"layouts given in full that ran: {given[0]}, kept before {given[1]}, after {given[2]}; runs (any "
        f"candidate kept): {runs[0]}, kept before {runs[1]}, after {runs[2]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
