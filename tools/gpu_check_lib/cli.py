"""Command line of tools/gpu_check.py: parse, refuse bad input with one line, run the parts, write the report."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from pathlib import Path

PARTS = {"kernels-step": ("kernels", "step", "memory"), "offload": ("offload", "size"), "fp8": ("fp8",)}
SECTIONS = tuple(section for sections in PARTS.values() for section in sections)
PART_BUDGET_S = 360.0  # each part must end within 6 minutes on one H100 (see the module docstring of gpu_check.py)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def parse(argv):
    parser = _Parser(prog="tools/gpu_check.py", description="GPU self-check: kernels, training step, memory, offload")
    parser.add_argument("--part", required=True, choices=[*PARTS, "all"], help="what to check (all: both parts)")
    parser.add_argument("--out", default="runs/gpu_check", help="directory for report.json and report.md")
    parser.add_argument("--dry-run", action="store_true", help="the same code path on CPU at tiny sizes")
    parser.add_argument(
        "--only",
        type=_sections,
        help=f"comma-separated sections of the part(s) to run, the rest left out ({', '.join(SECTIONS)})",
    )
    return parser.parse_args(argv)


def _sections(text: str) -> tuple[str, ...]:
    chosen = tuple(s.strip() for s in text.split(","))
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section {unknown[0]!r} (valid: {', '.join(SECTIONS)})")
    return chosen


def writable(path: str) -> Path:
    """`path` as a directory this process can write to (created if missing); ValueError (one line) if not."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".gpu_check_write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ValueError(f"--out {path} is not a writable directory ({error.strerror or error})") from None
    return out


def _peak(torch, device, dry_run: bool):
    """(dense bf16 TFLOP/s or None, what the figure is), and the device's name."""
    if dry_run:
        return (None, "n/a (dry run)"), "CPU (dry run)"
    from tools.gpu_check_lib.env import device_preset

    name = torch.cuda.get_device_name(device)
    _, hardware, note = device_preset(name, torch.cuda.get_device_properties(device).total_memory)
    return (hardware.peak_tflops if hardware else None, note), name


def _run_section(report, name: str, fn) -> None:
    """Run one section; an unexpected failure is reported (with its traceback on stderr) and the rest go on."""
    from tools.gpu_check_lib.runs import error_line

    try:
        fn()
    except Exception as error:
        traceback.print_exc()
        failures = next((s for s in report.sections if s.key == "failures"), None)
        if failures is None:
            failures = report.section("failures", "Sections that failed", ["section", "error"])
        failures.add(section=name, error=error_line(error))


def main(argv=None) -> int:
    from megatron.training.arguments.errors import report_error

    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        if args.dry_run:
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: our kernels on CPU
        else:
            import torch

            if not torch.cuda.is_available():
                raise ValueError("no CUDA device: this check needs one GPU (--dry-run runs its code on CPU)")
        out = writable(args.out)  # after the CUDA check: a refused run leaves no directory behind
    except ValueError as error:
        return report_error(error)
    import torch
    import triton

    from tools.gpu_check_lib import fp8_check, kernels_check, offload_tables, size_check, step_check
    from tools.gpu_check_lib.report import Report
    from tools.gpu_check_lib.runs import Context, start_process_group

    device = torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
    peak, name = _peak(torch, device, args.dry_run)
    start_process_group(device)
    report = Report(
        {
            "device": name,
            "peak": peak[1],
            "date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "versions": f"torch {torch.__version__}, triton {triton.__version__}",
            "dry run": args.dry_run,
            "budget per part": f"{PART_BUDGET_S:.0f} s",
        }
    )
    sections = {
        "kernels": lambda ctx: kernels_check.check_kernels(report, ctx),
        "step": lambda ctx: step_check.check_step(report, ctx, peak),
        "memory": lambda ctx: step_check.check_memory(report, ctx),
        "offload": lambda ctx: offload_tables.check_offload(report, ctx),
        "size": lambda ctx: size_check.check_size(report, ctx),
        "fp8": lambda ctx: fp8_check.check_fp8(report, ctx, peak),
    }
    for part in PARTS if args.part == "all" else [args.part]:
        ctx = Context(device, args.dry_run, PART_BUDGET_S)
        for section in (s for s in PARTS[part] if args.only is None or s in args.only):
            begin = time.perf_counter()
            _run_section(report, section, lambda s=section, c=ctx: sections[s](c))
            report.meta[f"section {section} wall s"] = round(time.perf_counter() - begin, 1)
            report.write(out)  # what has run so far survives a crash of a later section
        report.meta[f"part {part} wall s"] = round(time.perf_counter() - ctx.started, 1)
    report.write(out)
    print(report.text(), flush=True)
    print(f"report: {out / 'report.json'}, {out / 'report.md'}", flush=True)
    torch.distributed.destroy_process_group()
    return 0
