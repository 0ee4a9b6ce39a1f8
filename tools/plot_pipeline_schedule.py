#!/usr/bin/env python
"""Simulate a pipeline schedule, print its bubble fraction and draw its per-rank timeline.

    python tools/plot_pipeline_schedule.py --pp 4 --vpp 2 --microbatches 8 -o schedule.png

The timeline comes from the same action lists the executor runs
(`build_schedule`), timed by `simulate` with transfers taking no time. Each box
is one forward (light) or backward (dark) of the microbatch written in it,
coloured by local model chunk; blank space is idle time.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron.core.pipeline_parallel.schedules import ActionKind  # noqa: E402
from megatron.core.pipeline_parallel.simulate import (  # noqa: E402
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
    parser.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=_positive(int), required=True,
                        help="pipeline ranks")
    parser.add_argument("--vpp", type=_positive(int), default=1, help="model chunks (virtual stages) per rank")
    parser.add_argument("--microbatches", type=_positive(int), required=True, help="microbatches per iteration")
    parser.add_argument("--group-size", "--microbatch-group-size-per-virtual-pipeline-stage", dest="group_size",
                        type=_positive(int), default=None, help="interleaved schedule only (default: --pp)")
    parser.add_argument("--forward-time", type=_positive(float), default=1.0, help="duration of one chunk forward")
    parser.add_argument("--backward-time", type=_positive(float), default=2.0, help="duration of one chunk backward")
    parser.add_argument("-o", "--output", help="write the timeline image here (needs matplotlib)")
    return parser


def _shade(rgb: tuple, amount: float) -> tuple:
    """Mix a colour with white; amount 0 keeps it, 1 gives white."""
    return tuple(c + (1.0 - c) * amount for c in rgb[:3])


def draw(timeline: Timeline, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    palette = plt.get_cmap("tab10")
    forward_color = [_shade(palette(c % 10), 0.55) for c in range(timeline.v)]
    backward_color = [palette(c % 10)[:3] for c in range(timeline.v)]
    width = min(max(8.0, timeline.makespan * 0.3), 40.0)
    fig, ax = plt.subplots(figsize=(width, 0.55 * timeline.p + 1.8))
    for rank, events in enumerate(timeline.events):
        for e in events:
            forward = e.action.kind is ActionKind.FORWARD
            color = (forward_color if forward else backward_color)[e.action.chunk]
            ax.barh(rank, e.end - e.start, left=e.start, height=0.8, color=color, edgecolor="black", linewidth=0.5)
            ax.text((e.start + e.end) / 2, rank, str(e.action.microbatch), ha="center", va="center", fontsize=8,
                    color="black" if forward else "white")
    ax.set_yticks(range(timeline.p), [f"rank {r}" for r in range(timeline.p)])
    ax.invert_yaxis()
    ax.set_xlim(0, timeline.makespan)
    ax.set_xlabel("time")
    kinds = (("forward", forward_color), ("backward", backward_color))
    handles = [Patch(facecolor=colors[c], edgecolor="black", label=f"{name}, chunk {c}")
               for name, colors in kinds for c in range(timeline.v)]
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(handles), frameon=False,
              fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        timeline = simulate(args.pp, args.vpp, args.microbatches, group_size=args.group_size,
                            forward_time=args.forward_time, backward_time=args.backward_time)
    except ValueError as error:
        parser.error(str(error))
    simulated = max(bubble_fraction(timeline))
    analytic = analytic_bubble_fraction(args.pp, args.vpp, args.microbatches)
    group = f" group-size={args.group_size or args.pp}" if args.vpp > 1 else ""
    setup = (f"pp={args.pp} vpp={args.vpp} microbatches={args.microbatches}{group} "
             f"forward={args.forward_time:g} backward={args.backward_time:g}")
    print(f"{setup}: iteration time {timeline.makespan:g}, bubble fraction (idle / busy) simulated {simulated:.4f}, "
          f"analytic (p-1)/(v*m) {analytic:.4f}")
    if args.output:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            sys.exit("error: drawing the timeline needs matplotlib: pip install matplotlib")
        draw(timeline, args.output, f"{setup}: bubble {simulated:.4f} simulated, {analytic:.4f} = (p-1)/(v·m)")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
