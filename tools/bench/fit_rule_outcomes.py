#!/usr/bin/env python
"""Published layouts that ran and that ran out of memory, kept or dropped: the 80% rule before
issue 36 against fit_rule.fit_verdict.

    python tools/bench/fit_rule_outcomes.py

The layouts, each with its published outcome:

* ran: the runs of tools/bench/published_runs.py (SC21 Table 1 on A100 80 GB, Megatron-Core r0.8
  weak scaling on H100 80 GB). Megatron-Core does not publish micro batch and virtual stages, so
  for its rows every candidate the calibration considers (micro batch 1, 2, 4, every
  virtual-stage count) is counted, one of which ran: a row whose candidates are all dropped drops
  the run;
* `MEMORY_RUNS` of published_memory_outcomes.py: Llama-3.1-8B on 8 x H100 94 GB (ran), and BigScience's
  BLOOM-176B layout search on 384 A100 80 GB (Megatron-DeepSpeed), rows that ran and rows that ran
  out of memory ("OOM"); "measured" is the memory the chronicle reports for a row that ran; the
  rows of 02-28 ran DeepSpeed's BF16_Optimizer, whose bf16 gradients (2 bytes a parameter of the
  rank, `DEEPSPEED_BF16_OPTIMIZER`) are added to our estimate for both rules; and out-of-memory
  reports of Megatron-LM itself whose flags are given in full (`MEGATRON_LM_RUNS`: GitHub issue
  NVIDIA/Megatron-LM#525, a 771M GPT on one V100 32 GB); and Fujii et al.'s 4D sweep of Llama-3.1-8B
  with Megatron-LM (`FUJII_RUNS`: 292 layouts on A100 40 GB and H100 94 GB, 124 out of memory).

Before: the estimate as it was (fragmentation 10% of the dynamic memory, runtime 1 GiB, no NCCL
buffers, no document mask), kept when its total is within 80% of the device (Fujii et al.'s rule).
After: the estimate with NCCL buffers per communicator, kept when fit_verdict says "fits". The
last lines: of the layouts that ran, how many each rule drops (wrongly); of those that ran out of
memory, how many each rule keeps (wrongly).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.planning.budget import GIB  # noqa: E402
from megatron.planning.estimator import estimate_memory  # noqa: E402
from megatron.planning.fit_rule import fit_verdict  # noqa: E402
from megatron.planning.hardware import DEVICES  # noqa: E402
from megatron.planning.transients import FRAGMENTATION_FRACTION, Allowances  # noqa: E402
from megatron.training.arguments.tool_command_line import run_config_for_tool  # noqa: E402
from megatron.training.memory_check import layout_from_run  # noqa: E402
from tools.bench.planner_calibration import run_layouts  # noqa: E402
from tools.bench.published_memory_outcomes import MEMORY_RUNS  # noqa: E402
from tools.bench.published_runs import RUNS  # noqa: E402

PROG = "tools/bench/fit_rule_outcomes.py"
BEFORE = Allowances(FRAGMENTATION_FRACTION, 1 << 30)  # as before issue 36: runtime 1 GiB, no NCCL buffers
FUJII_SHARE = 0.8


def with_optimizer(estimate, optimizer):
    """`estimate` with what another framework's optimizer (published_memory_outcomes.OtherOptimizer) holds beyond
    ours added to each rank's gradients, in bytes per parameter of the rank; None: unchanged."""
    if optimizer is None:
        return estimate
    extra = optimizer.extra_grad_bytes_per_parameter
    ranks = tuple(replace(r, grads_bytes=r.grads_bytes + extra * r.parameters) for r in estimate.ranks)
    return replace(estimate, ranks=ranks)


def kept(config, layout, device_bytes: int, optimizer=None) -> tuple[bool, bool, float, str]:
    """(kept before, kept after, total GiB after, verdict after) of one layout; `optimizer`: the
    published row's other optimizer, whose extra bytes both rules count."""
    before = with_optimizer(estimate_memory(config, layout, allowances=BEFORE), optimizer)
    verdict = fit_verdict(with_optimizer(estimate_memory(config, layout), optimizer), device_bytes)
    return before.max_total_bytes <= FUJII_SHARE * device_bytes, verdict.fits, verdict.total_bytes / GIB, verdict.label


def rows():
    """(name, device GiB, layouts, kept before, kept after, detail, out of memory) per run."""
    for run in RUNS:
        device_bytes = int(DEVICES[run.device].memory_gib * GIB)
        outcomes = [kept(cfg, lay, device_bytes) for cfg, lay in run_layouts(run)]
        detail = outcomes[0][3] if len(outcomes) == 1 else "candidates (mbs, v); one ran"
        yield run.name, device_bytes / GIB, outcomes, detail, False
    for run in MEMORY_RUNS:
        device_bytes = int(run.device_memory_gib * GIB)
        outcome = kept(*memory_run_model_and_layout(run), device_bytes, run.optimizer)
        measured = f", measured {run.measured_gb:g} GB" if run.measured_gb is not None else ""
        yield run.name, device_bytes / GIB, [outcome], f"{outcome[3]} ({outcome[2]:.2f} GiB{measured})", run.oom


def memory_run_model_and_layout(run):
    """(model config, layout) of a `MEMORY_RUNS` row, the layout with its gradient buffer's element."""
    args = run_config_for_tool(list(run.flags), run.family, run.num_gpus, PROG)
    return args.model, layout_from_run(args, "cuda").with_ddp(grad_dtype=run.grad_dtype)


def _share(part: int, whole: int) -> str:
    return f"{part} ({part / whole:.0%})" if whole else "0"


def main() -> int:
    print(f"{'run':<42} {'outcome':>7} {'GiB':>6} {'layouts':>7} {'kept before':>11} {'kept after':>10}  after")
    given = [0, 0, 0]  # layouts given in full that ran: count, kept before, kept after
    runs = [0, 0, 0]  # runs: count, some candidate kept before, after
    ooms = [0, 0, 0]  # layouts that ran out of memory: count, kept before, kept after
    for name, gib, outcomes, detail, oom in rows():
        before, after = sum(o[0] for o in outcomes), sum(o[1] for o in outcomes)
        outcome = "OOM" if oom else "ran"
        print(f"{name:<42} {outcome:>7} {gib:6.2f} {len(outcomes):7d} {before:11d} {after:10d}  {detail}")
        if oom:
            ooms = [ooms[0] + 1, ooms[1] + before, ooms[2] + after]
            continue
        if len(outcomes) == 1:
            given = [given[0] + 1, given[1] + before, given[2] + after]
        runs = [runs[0] + 1, runs[1] + (before > 0), runs[2] + (after > 0)]
    print(
        f"ran, layouts given in full: {given[0]}, dropped before {_share(given[0] - given[1], given[0])}, "
        f"after {_share(given[0] - given[2], given[0])}; runs (dropped: no candidate kept): {runs[0]}, dropped "
        f"before {_share(runs[0] - runs[1], runs[0])}, after {_share(runs[0] - runs[2], runs[0])}"
    )
    print(f"out of memory: {ooms[0]} layouts, kept before {_share(ooms[1], ooms[0])}, after {_share(ooms[2], ooms[0])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
