#!/usr/bin/env python
"""Simulate a pipeline schedule, print its bubble fraction and draw its per-rank timeline.

    python tools/plot_pipeline_schedule.py --pp 4 --vpp 2 --microbatches 8 -o schedule.png
    python tools/plot_pipeline_schedule.py --pp 4 --microbatches 8 --schedule zb-h1 --weight-time 1 -o zb.png
    python tools/plot_pipeline_schedule.py --pp 2 --vpp 2 --microbatches 8 --measured trace.json -o measured.png

The timeline comes from the same action lists the executor runs
(`build_schedule`), timed by `simulate` with transfers taking no time. Each box
is one forward (light) or backward (dark) of the microbatch written in it,
coloured by local model chunk; blank space is idle time.

With --measured (a trace written by `tools/bench/pipeline.py --trace`), it draws
for each schedule benchmarked the planned timeline (simulated with the
measured median forward and backward times of our executor) above the measured
step of ours and of torch.distributed.pipelining: compute boxes as above, time
spent posting transfers in black, waiting for them in grey.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron.core.pipeline_parallel.schedules import KINDS, ZERO_BUBBLE, ActionKind  # noqa: E402
from megatron.planning.pipeline_simulator import (  # noqa: E402
    Timeline,
    analytic_bubble_fraction,
    bubble_fraction,
    simulate,
)


def _positive(convert):
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {convert.__name__}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {convert.__name__}, got {text!r}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pp", "--pipeline-model-parallel-size", dest="pp", type=_positive(int), required=True, help="pipeline ranks"
    )
    parser.add_argument("--vpp", type=_positive(int), default=1, help="model chunks (virtual stages) per rank")
    parser.add_argument("--microbatches", type=_positive(int), required=True, help="microbatches per iteration")
    parser.add_argument(
        "--group-size",
        "--microbatch-group-size-per-virtual-pipeline-stage",
        dest="group_size",
        type=_positive(int),
        default=None,
        help="interleaved schedule only (default: --pp)",
    )
    parser.add_argument("--forward-time", type=_positive(float), default=1.0, help="duration of one chunk forward")
    parser.add_argument("--backward-time", type=_positive(float), default=2.0, help="duration of one chunk backward")
    parser.add_argument(
        "--schedule",
        choices=[kind for kind in KINDS if kind != "none"],
        default="auto",
        help="the schedule (auto: 1f1b, or interleaved with --vpp > 1); the zero-bubble kinds split "
        "each backward into input gradients and a --weight-time weight-gradient step",
    )
    parser.add_argument(
        "--weight-time",
        type=_positive(float),
        help="zero-bubble schedules: the part of --backward-time the weight gradients take (default half)",
    )
    parser.add_argument(
        "--measured",
        help="a trace from tools/bench/pipeline.py --trace: draw the planned "
        "timeline next to the measured ones of the --pp/--microbatches run in it (needs -o)",
    )
    parser.add_argument("-o", "--output", help="write the timeline image here (needs matplotlib)")
    return parser


def _shade(rgb: tuple, amount: float) -> tuple:
    """Mix a colour with white; amount 0 keeps it, 1 gives white."""
    return tuple(c + (1.0 - c) * amount for c in rgb[:3])


SPAN_KINDS = {ActionKind.FORWARD: "forward", ActionKind.BACKWARD: "backward", ActionKind.WEIGHT: "weight"}


def planned_spans(timeline: Timeline) -> list[list[tuple]]:
    """The simulated timeline as per-rank spans (kind, microbatch, chunk, start, end), as the executor records them."""
    return [
        [(SPAN_KINDS[e.action.kind], e.action.microbatch, e.action.chunk, e.start, e.end) for e in events]
        for events in timeline.events
    ]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw_rows(ax, ranks: list, v: int, end: float, label: bool) -> list:
    """One row of spans per rank on `ax`; returns the legend handles."""
    from matplotlib.patches import Patch

    palette = _pyplot().get_cmap("tab10")
    forward_color = [_shade(palette(c % 10), 0.55) for c in range(v)]
    backward_color = [palette(c % 10)[:3] for c in range(v)]
    for rank, spans in enumerate(ranks):
        for kind, microbatch, chunk, start, stop in spans:
            if kind in ("post", "wait"):
                ax.barh(
                    rank + 0.3,
                    stop - start,
                    left=start,
                    height=0.2,
                    linewidth=0,
                    color="black" if kind == "post" else "0.6",
                )
                continue
            forward = kind == "forward"
            color = (forward_color if forward else backward_color)[chunk]
            ax.barh(
                rank - 0.1,
                stop - start,
                left=start,
                height=0.6,
                color=color,
                edgecolor="black",
                linewidth=0.5,
                hatch="//" if kind == "weight" else None,
            )
            if label:
                ax.text(
                    (start + stop) / 2,
                    rank - 0.1,
                    str(microbatch),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if forward else "white",
                )
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, end)
    kinds = (("forward", forward_color), ("backward", backward_color))
    return [
        Patch(facecolor=colors[c], edgecolor="black", label=f"{name}, chunk {c}")
        for name, colors in kinds
        for c in range(v)
    ] + [
        Patch(facecolor="white", edgecolor="black", hatch="//", label="weight gradients (split backward)"),
        Patch(color="black", label="posting transfers"),
        Patch(color="0.6", label="waiting for transfers"),
    ]


def draw(timeline: Timeline, path: str, title: str) -> None:
    plt = _pyplot()
    width = min(max(8.0, timeline.makespan * 0.3), 40.0)
    fig, ax = plt.subplots(figsize=(width, 0.55 * timeline.p + 1.8))
    handles = _draw_rows(ax, planned_spans(timeline), timeline.v, timeline.makespan, label=True)[: 2 * timeline.v]
    ax.set_xlabel("time")
    ax.legend(
        handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(handles), frameon=False, fontsize=8
    )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def _median_duration(ranks: list, kind: str) -> float | None:
    durations = sorted(stop - start for spans in ranks for k, _, _, start, stop in spans if k == kind)
    return durations[len(durations) // 2] if durations else None


def draw_measured(config: dict, path: str, group_size: int | None) -> None:
    """Planned, ours measured and torch measured, for both schedules of one benchmark configuration."""
    plt = _pyplot()
    p, v, m = config["p"], config["v"], config["m"]
    runs = {(run["schedule"], run["side"]): run for run in config["runs"]}
    schedules = list(dict.fromkeys(run["schedule"] for run in config["runs"]))
    panels = []
    for schedule in schedules:
        ours = runs[(schedule, "ours")]
        chunks = 1 if schedule in ("1f1b", "zb-h1") else v
        forward, backward, weight = (
            _median_duration(ours["ranks"], kind) for kind in ("forward", "backward", "weight")
        )
        plan = simulate(
            p,
            chunks,
            m,
            kind=schedule,
            group_size=None if chunks == 1 else group_size,
            forward_time=forward,
            backward_time=backward + (weight or 0.0),
            split_backward=weight is not None,
            weight_time=weight,
        )
        split = "" if weight is None else f", weight gradients {weight * 1e3:.1f} ms"
        panels.append(
            (
                f"{schedule} planned (simulated from our median forward {forward * 1e3:.1f} ms, "
                f"backward {backward * 1e3:.1f} ms{split}): {plan.makespan * 1e3:.0f} ms",
                planned_spans(plan),
                chunks,
                plan.makespan,
            )
        )
        for side in ("ours", "torch"):
            run = runs[(schedule, side)]
            panels.append(
                (
                    f"{schedule} measured, {side}: {run['step_seconds'] * 1e3:.0f} ms (slowest rank)",
                    run["ranks"],
                    chunks,
                    run["step_seconds"],
                )
            )
    end = max(panel[3] for panel in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(16, (0.4 * p + 0.7) * len(panels) + 1.0), sharex=True)
    handles = []
    for ax, (title, ranks, chunks, _) in zip(axes, panels):
        to_ms = [[(k, mb, c, start * 1e3, stop * 1e3) for k, mb, c, start, stop in spans] for spans in ranks]
        drawn = _draw_rows(ax, to_ms, chunks, end * 1e3, label=p * m <= 32)
        handles = drawn if len(drawn) > len(handles) else handles
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1].set_xlabel("ms since the step started")
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=8)
    fig.suptitle(
        f"pipeline step p={p} m={m} v={v}, CPU gloo (1-minute load {config['load']:.1f}): planned vs measured",
        fontsize=10,
        y=0.995,
    )
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _measured_config(parser, args) -> dict:
    try:
        configs = json.loads(Path(args.measured).read_text())["configs"]
    except (OSError, ValueError, KeyError) as error:
        parser.error(f"cannot read the trace {args.measured}: {error}")
    for config in configs:
        if (config["p"], config["m"], config["v"]) == (args.pp, args.microbatches, args.vpp):
            return config
    found = ", ".join(f"--pp {c['p']} --microbatches {c['m']} --vpp {c['v']}" for c in configs)
    parser.error(
        f"{args.measured} holds no run with --pp {args.pp} --microbatches {args.microbatches} "
        f"--vpp {args.vpp}; it holds: {found}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.measured and not args.output:
        parser.error("--measured needs -o/--output")
    try:
        timeline = simulate(
            args.pp,
            args.vpp,
            args.microbatches,
            group_size=args.group_size,
            kind=args.schedule,
            forward_time=args.forward_time,
            backward_time=args.backward_time,
            weight_time=args.weight_time,
        )
    except ValueError as error:
        parser.error(str(error))
    if args.weight_time is not None and args.schedule not in ZERO_BUBBLE:
        parser.error("--weight-time applies to the zero-bubble schedules (--schedule zb-h1, zbv or interleaved-zb)")
    simulated = max(bubble_fraction(timeline))
    analytic = analytic_bubble_fraction(args.pp, args.vpp, args.microbatches)
    group = f" group-size={args.group_size or args.pp}" if args.vpp > 1 and args.schedule != "zbv" else ""
    setup = (
        f"pp={args.pp} vpp={args.vpp} microbatches={args.microbatches}{group} "
        f"forward={args.forward_time:g} backward={args.backward_time:g} schedule={args.schedule}"
    )
    print(
        f"{setup}: iteration time {timeline.makespan:g}, bubble fraction (idle / busy) simulated {simulated:.4f}, "
        f"analytic (p-1)/(v*m) {analytic:.4f}"
    )
    if args.output:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            sys.exit("error: drawing the timeline needs matplotlib: pip install matplotlib")
        if args.measured:
            draw_measured(_measured_config(parser, args), args.output, args.group_size)
        else:
            draw(timeline, args.output, f"{setup}: bubble {simulated:.4f} simulated, {analytic:.4f} = (p-1)/(v·m)")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
