"""The GPU check's parts: a registry of name -> sections, time budget, order in `--part all`.

A part plugs in with one `Part(...)` entry in PARTS: its sections are (name, "module:function",
seconds a GPU run needs to start it) triples, the function `function(report, ctx)` of
tools/gpu_check_lib/<module>.py, imported only when the section runs; a section that would start
with less of its part's time left than it needs is skipped and the report says so (sections
that run several measurements also skip each one that no longer fits). `--part all` runs every
part in `order` (lowest first: the newest measurements, those no GPU run has taken yet, come
first) under one deadline, RUN_LIMIT_S less the wrapper's allowance; each part's own deadline is
its budget or what is left of that, the smaller (runs.Context), so `--part all` ends within one
device call however the budgets sum.
`budget_line()` says how they sum against that limit.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

RUN_LIMIT_S = 600.0  # one device `run` call (tools/gpu_check_device.sh prints it)
WRAPPER_ALLOWANCE_S = 60.0  # installing the carried wheels, starting Python and CUDA, before main() starts timing


@dataclass(frozen=True)
class Part:
    name: str
    issue: int
    order: int
    budget_s: float
    sections: tuple[tuple[str, str, float], ...]  # (section name, "module:function", seconds it needs to start)


PARTS = (
    # ours' four rows took 27 s on an H200 (2026-11-28); torchtitan's three compiled float8 rows (~60 s each,
    # not yet measured) run last and take what is left of the budget
    Part("fp8", 44, order=20, budget_s=150.0, sections=(
        ("fp8", "parts:check_fp8", 30.0),  # also writes fp8_ops and fp8_layer
    )),
    Part("moe", 45, order=30, budget_s=70.0, sections=(
        ("moe", "moe_check:check_moe", 20.0),  # 9 s on an H200, 2026-11-28
        ("moe_models", "moe_check:check_moe_models", 20.0),  # 4 s (one model: the other skipped itself)
    )),
    Part("throughput", 43, order=10, budget_s=300.0, sections=(
        # 220 s on an H200 (torchtitan compiled skipped: 85 s reserved, 69 s left), 2026-11-28; the five 8-layer
        # rows run there took 138 s, and torchtitan compiled now reserves 45 s (throughput_check.NEED_S)
        ("throughput", "throughput_check:check_throughput", 60.0),
    )),
    Part("offload", 35, order=40, budget_s=110.0, sections=(
        ("adam_bits", "offload_adam_bits:check_adam_bits", 30.0),  # 21 s on an H200, 2026-11-28
        ("size", "size_check:check_size", 90.0),  # 109 s on an H200, a fresh process per member, 2026-11-28
        ("offload", "offload_tables:check_offload", 40.0),
    )),
    Part("kernels-step", 34, order=50, budget_s=360.0, sections=(
        ("kernels", "kernels_check:check_kernels", 40.0),  # measured 28-30 s with compilation
        ("step", "parts:check_step", 60.0),  # measured 43 s
        ("memory", "step_check:check_memory", 45.0),
    )),
)  # fmt: skip


def by_name() -> dict[str, Part]:
    return {part.name: part for part in PARTS}


def ordered() -> list[Part]:
    return sorted(PARTS, key=lambda part: part.order)


def section_names() -> tuple[str, ...]:
    return tuple(name for part in ordered() for name, _, _ in part.sections)


def budget_total() -> float:
    return sum(part.budget_s for part in PARTS)


def all_deadline_s() -> float:
    """Seconds `--part all` may run, timed from main()'s start."""
    return RUN_LIMIT_S - WRAPPER_ALLOWANCE_S


def budget_line() -> str:
    """How the parts' budgets sum against what one `--part all` may take."""
    terms = " + ".join(f"{part.name} {part.budget_s:.0f}" for part in ordered())
    total, limit = budget_total(), all_deadline_s()
    verdict = (
        "fits"
        if total <= limit
        else f"over by {total - limit:.0f} s: the last parts get what is left and skip the sections that do not fit"
    )
    return (
        f"{terms} = {total:.0f} s of budgets against {limit:.0f} s for --part all "
        f"({RUN_LIMIT_S:.0f} s device call less {WRAPPER_ALLOWANCE_S:.0f} s to start): {verdict}"
    )


def check_fp8(report, ctx) -> None:
    """fp8_check.check_fp8 with the device's peak (ctx.peak), as a section function."""
    from tools.gpu_check_lib import fp8_check

    fp8_check.check_fp8(report, ctx, ctx.peak)


def check_step(report, ctx) -> None:
    """step_check.check_step with the device's peak (ctx.peak), as a section function."""
    from tools.gpu_check_lib import step_check

    step_check.check_step(report, ctx, ctx.peak)


def section_runner(target: str):
    """The function `function(report, ctx)` named by "module:function" (imported now)."""
    module, function = target.split(":")
    return getattr(importlib.import_module(f"tools.gpu_check_lib.{module}"), function)
