"""Command line of tools/gpu_check.py: parse, refuse bad input with one line, run the parts, write the report."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from pathlib import Path


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def parse(argv):
    from tools.gpu_check_lib import parts

    names = parts.section_names()
    parser = _Parser(prog="tools/gpu_check.py", description="GPU self-check: one prepared run of every GPU part")
    parser.add_argument(
        "--part", required=True, choices=[*parts.by_name(), "all"], help="what to check (all: every part)"
    )
    parser.add_argument("--out", default="runs/gpu_check", help="directory for report.json and report.md")
    parser.add_argument("--dry-run", action="store_true", help="the same code path on CPU at tiny sizes")
    for flag, what in (("--only", "to run, the rest left out"), ("--skip", "to leave out")):
        parser.add_argument(flag, type=_sections(flag), help=f"comma-separated sections {what} ({', '.join(names)})")
    args = parser.parse_args(argv)
    chosen = [p for p in parts.ordered() if args.part in ("all", p.name)]
    offered = [name for p in chosen for name, _, _ in p.sections]
    for flag in ("--only", "--skip"):
        stray = [s for s in getattr(args, flag[2:]) or () if s not in offered]
        if stray:
            raise ValueError(
                f"{flag} {stray[0]}: not a section of --part {args.part} (its sections: {', '.join(offered)})"
            )
    args.parts = chosen
    return args


def _sections(flag: str):
    def parse_list(text: str) -> tuple[str, ...]:
        from tools.gpu_check_lib.parts import section_names

        chosen = tuple(s.strip() for s in text.split(","))
        unknown = [s for s in chosen if s not in section_names()]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown section {unknown[0]!r} (valid: {', '.join(section_names())})")
        return chosen

    return parse_list


def _wanted(args, section: str) -> bool:
    return (args.only is None or section in args.only) and (args.skip is None or section not in args.skip)


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
        _note_section(report, "failures", "Sections that failed", name, error_line(error))


def _note_section(report, key: str, title: str, name: str, why: str) -> None:
    """A row (section, why) in the report's table `key`, made when first needed."""
    table = next((s for s in report.sections if s.key == key), None)
    if table is None:
        table = report.section(key, title, ["section", "why"])
    table.add(section=name, why=why)


def run_part(report, out: Path, part, args, ctx) -> None:
    """The part's chosen sections in order, each skipped when less of the part's time is left than
    it needs to start; the report is rewritten after each."""
    from tools.gpu_check_lib import parts

    for section, target, need_s in (s for s in part.sections if _wanted(args, s[0])):
        skipped = ctx.skip(need_s)
        if skipped:
            _note_section(report, "sections_skipped", "Sections skipped", section, skipped)
            continue
        begin = time.perf_counter()
        _run_section(report, section, lambda t=target, c=ctx: parts.section_runner(t)(report, c))
        report.meta[f"section {section} wall s"] = round(time.perf_counter() - begin, 1)
        report.write(out)  # what has run so far survives a crash of a later section
    report.write(out)


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

    from tools.gpu_check_lib import parts
    from tools.gpu_check_lib.report import Report
    from tools.gpu_check_lib.runs import Context, start_process_group

    started = time.perf_counter()
    deadline = started + parts.all_deadline_s() if args.part == "all" else None
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
            "command": "tools/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "budgets": parts.budget_line(),
        }
    )
    for part in args.parts:
        budget = part.budget_s if deadline is None else max(0.0, min(part.budget_s, deadline - time.perf_counter()))
        ctx = Context(device, args.dry_run, budget, peak=peak)
        report.meta[f"part {part.name} budget s"] = round(budget, 1)
        run_part(report, out, part, args, ctx)
        report.meta[f"part {part.name} wall s"] = round(time.perf_counter() - ctx.started, 1)
    report.meta["total wall s"] = round(time.perf_counter() - started, 1)
    report.write(out)
    print(report.text(), flush=True)
    print(f"report: {out / 'report.json'}, {out / 'report.md'}", flush=True)
    torch.distributed.destroy_process_group()
    return 0
