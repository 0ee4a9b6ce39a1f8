#!/usr/bin/env python
"""Pipeline schedules on CPU: ours vs torch.distributed.pipelining's, schedule by schedule.

    python tools/bench/pipeline.py [--schedules 1f1b,interleaved,zb-h1,zbv,interleaved-zb] [--pp 2 4]
        [--microbatches 8 16] [--vpp 2] [--quick] [--clock wall|cpu|transport] [--trace FILE] [--json FILE]

Schedules and torch's counterpart of each: 1f1b (Schedule1F1B), interleaved (ScheduleInterleaved1F1B),
interleaved-zb (ScheduleInterleavedZeroBubble), zbv (ScheduleZBVZeroBubble: two chunks per rank in
V placement on both sides, rank r holding stages r and 2p-1-r, so --vpp must be 2 when zbv runs),
zb-h1 (torch has no class: its `_PipelineScheduleRuntime` runs our action list, compute only, torch
adding the transfers).

--pp 1 (1f1b only) runs both sides in one process: the step's whole work (executor or torch's
schedule, layers, loss, gradients) without transfers.

For every (pp, microbatches) pair, launches pp forked gloo ranks (one intra-op thread each) that hold a stack of
identical residual MLP blocks split into equal-cost stages: p stages for 1F1B,
p*v for the interleaved schedule (same blocks, same weights, same microbatches).
Each schedule runs through our PipelineExecutor and through torch's PipelineStage +
its schedule class. Each side builds the blocks as its users
would: ours from our linear layers (tp=1) in chunks wrapped in ModelChunkBuffers,
as the trainer does, with gradient accumulation fusion (weight gradients added into
the fp32 main_grad buffer by one addmm; --no-gradient-accumulation-fusion makes the
product and adds it, as autograd does, leaving the schedule as the only difference); torch's from torch.nn.Linear,
gradients accumulated by autograd into .grad. --split-backward runs ours with the
trainer's --split-backward for 1f1b and interleaved (weight gradients after the input
gradient is sent; torch's 1F1B and interleaved schedules have no such option; the
zero-bubble schedules always split, on both sides). Before timing, one step
of each checks that both produce the same losses and gradients: equal work is
the precondition for comparing time. Then the runs alternate (warm-up
first; each round rotates the schedules, runs each schedule's two sides back to
back and alternates which side goes first; 30 rounds by default, as a shared 2-core
machine moves a 10-round run's median ratio by up to 0.08); a step's time is the slowest rank's, and
the table shows medians next to the simulated bubble of our schedule (idle / busy, F = 1,
B = 2 of which W = 1 in the zero-bubble ones, free transfers). A second table says where each rank's step time
goes on both sides: compute (forward, backward), posting transfers, waiting for
them, and the rest (Python, loss, idle between). Ours comes from the executor's
spans, torch's from wrapping its stages' forward/backward and its schedule
module's `_batch_p2p` (post) and `_wait_batch_p2p` (wait). --trace writes the
median step of every run as a timeline that `tools/plot_pipeline_schedule.py
--measured` draws next to the planned one. --json FILE (one --pp and one --microbatches)
writes {schedule: {ours_over_torch, ours_ms, torch_ms, simulated_bubble}}.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron.core.distributed.model_chunk_buffers import DDPConfig, ModelChunkBuffers  # noqa: E402
from megatron.core.parallel_state import ParallelDims, ParallelMesh  # noqa: E402
from megatron.core.pipeline_parallel.executor import COMPUTE_SPANS, PipelineExecutor, PipelineSpec  # noqa: E402
from megatron.core.pipeline_parallel.placement import Placement  # noqa: E402
from megatron.core.pipeline_parallel.schedules import ActionKind, build_schedule  # noqa: E402
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.planning.pipeline_simulator import bubble_fraction, simulate  # noqa: E402
from megatron.testing.forked_ranks import run_distributed  # noqa: E402

LOSS_RTOL = 1e-5
CLOCKS = {
    "wall": time.perf_counter,
    "cpu": time.process_time,  # every thread, gloo's included
    "transport": lambda: time.process_time() - time.thread_time(),  # every thread but the one running the step
}
MEASURES = {
    "wall": "the slowest rank's step time",
    "cpu": "the CPU time of all ranks per step (ms below)",
    "transport": "the CPU time of all ranks' transport threads per step (ms below)",
}
GRAD_RTOL = 1e-4
# schedule -> torch.distributed.pipelining's counterpart (None: our action list through its runtime)
TORCH_SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": None,
    "zbv": "ScheduleZBVZeroBubble",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
}
ONE_CHUNK = ("1f1b", "zb-h1")
ZERO_BUBBLE = ("zb-h1", "zbv", "interleaved-zb")


def chunks_per_rank(schedule: str, v: int) -> int:
    return 1 if schedule in ONE_CHUNK else 2 if schedule == "zbv" else v


def simulated_bubble(schedule: str, p: int, v: int, m: int) -> float:
    """Our schedule's bubble (idle / busy) with F = 1, B = 2 (W = 1 of it where split), free transfers."""
    timeline = simulate(p, chunks_per_rank(schedule, v), m, kind=schedule, forward_time=1.0, backward_time=2.0)
    return max(bubble_fraction(timeline))


# ----------------------------------------------------------------------------- model


class Block(torch.nn.Module):
    """x + W2 gelu(W1 x): every block costs the same."""

    def __init__(self, fc1: torch.nn.Module, fc2: torch.nn.Module):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def torch_block(hidden: int, ffn: int) -> Block:
    return Block(torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden))


def our_block(reference: Block, tp_group, fusion: bool) -> Block:
    """The same weights in our column- and row-parallel linear layers (tp=1)."""
    ffn, hidden = reference.fc1.weight.shape
    layers = dict(tp_group=tp_group, bias=True, init_std=0.02, gradient_accumulation_fusion=fusion)
    block = Block(ColumnParallelLinear(hidden, ffn, **layers), RowParallelLinear(ffn, hidden, **layers))
    block.load_state_dict(reference.state_dict())
    return block


class Stage(torch.nn.Module):
    """Consecutive blocks. With labels (our last stage) it returns the per-token loss the executor
    expects; torch's last stage returns the output and its loss_fn computes the same mean."""

    def __init__(self, blocks: list):
        super().__init__()
        self.blocks = torch.nn.Sequential(*blocks)

    def forward(self, x, labels=None, loss_mask=None):  # the executor passes the mask; this loss ignores it
        y = self.blocks(x)
        if labels is None:
            return y
        return (y - labels).pow(2).mean(-1)


def torch_loss(output, target):
    return (output - target).pow(2).mean()


# ----------------------------------------------------------------------------- one rank


class Ours:
    def __init__(self, stages: list, mesh, args, schedule: str):
        self.chunks = [ModelChunkBuffers(s, DDPConfig(), mesh.dp_cp_group) for s in stages]
        spec = PipelineSpec(
            p2p_shape=(args.tokens, 1, args.hidden),
            p2p_dtype=torch.float32,
            num_microbatches=args.microbatches,
            split_backward=args.split_backward,
            schedule=schedule,
        )
        self.executor = PipelineExecutor(self.chunks, mesh, spec)
        self.last = any(self.executor.placement.is_last(mesh.pp_rank, c) for c in range(len(stages)))
        self.spans = []  # per step: the executor's spans, seconds since the step's start

    def step(self, data) -> float | None:
        """Mean loss over the iteration's tokens (last stage), else None."""
        x, labels, mask = data

        def batch(mb):
            return x[mb], labels[mb], mask

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        stats = self.executor.run(batch)
        for chunk in self.chunks:
            chunk.finish_grad_sync()
        self.spans.append([tuple(span) for span in stats.spans])
        return (stats.loss_sum / stats.tokens).item() if self.last else None

    def grads(self) -> list:
        return [p.main_grad.clone() for c in self.chunks for p in c.module.parameters()]


class _TorchSpans:
    """Torch's schedule as spans in our executor's terms: its stages' forward_one_chunk /
    backward_one_chunk are compute, its schedule module's `_batch_p2p` is posting and
    `_wait_batch_p2p` is waiting (both are looked up as module globals at every call)."""

    current: list | None = None

    @classmethod
    def install(cls) -> None:
        from torch.distributed.pipelining import schedules

        for name, kind in (("_batch_p2p", "post"), ("_wait_batch_p2p", "wait")):
            setattr(schedules, name, cls._wrap(getattr(schedules, name), kind))

    @classmethod
    def wrap_stage(cls, stage, p: int) -> None:
        chunk = stage.stage_index // p
        compute = (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"))
        for name, kind in compute + (("backward_weight_one_chunk", "weight"),):
            setattr(stage, name, cls._wrap(getattr(stage, name), kind, chunk))

    @classmethod
    def _wrap(cls, fn, kind: str, chunk: int | None = None):
        def timed(*args, **kwargs):
            if cls.current is None:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            microbatch = args[0] if kind in COMPUTE_SPANS else None
            cls.current.append(
                (kind, microbatch, chunk if microbatch is not None else None, start, time.perf_counter())
            )
            return out

        return timed


class Theirs:
    def __init__(self, stages: list, stage_indices: list, mesh, args, schedule: str):
        from torch.distributed.pipelining import PipelineStage, schedules

        self.modules = stages
        num_stages = args.pp * len(stages)
        self.stages = [
            PipelineStage(module, index, num_stages, torch.device("cpu"), group=mesh.pp_group)
            for module, index in zip(stages, stage_indices)
        ]
        for stage in self.stages:
            _TorchSpans.wrap_stage(stage, args.pp)
        self.first = any(s.is_first for s in self.stages)
        self.last = any(s.is_last for s in self.stages)
        name = TORCH_SCHEDULES[schedule]
        if name == "Schedule1F1B":
            self.schedule = schedules.Schedule1F1B(self.stages[0], args.microbatches, loss_fn=torch_loss)
        elif name is not None:
            self.schedule = getattr(schedules, name)(self.stages, args.microbatches, loss_fn=torch_loss)
        else:  # no class of torch's: its runtime runs our compute order, adding its own transfers
            self.schedule = schedules._PipelineScheduleRuntime(self.stages, args.microbatches, loss_fn=torch_loss)
            self.schedule._prepare_schedule_with_comms(torch_actions(schedule, args.pp, len(stages), args.microbatches))
        self.spans = []

    def step(self, data) -> float | None:
        """Mean of the microbatch losses (last stage), else None."""
        x, labels, _ = data
        for module in self.modules:
            module.zero_grad(set_to_none=True)
        losses = [] if self.last else None
        # the whole batch, split by the schedule along dim 0 into the same [s, 1, h] microbatches
        inputs = (x.flatten(0, 1),) if self.first else ()
        target = labels.flatten(0, 1) if self.last else None
        _TorchSpans.current, started = [], time.perf_counter()
        self.schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        self.spans.append([(k, mb, c, a - started, b - started) for k, mb, c, a, b in _TorchSpans.current])
        _TorchSpans.current = None
        return sum(loss.item() for loss in losses) / len(losses) if self.last else None

    def grads(self) -> list:
        return [p.grad.detach().clone() for m in self.modules for p in m.parameters()]


def torch_actions(schedule: str, p: int, v: int, m: int) -> dict:
    """Every rank's compute order of our `schedule` as torch's compute-only actions (stages numbered by the
    schedule's placement)."""
    from torch.distributed.pipelining import schedules

    kinds = {
        ActionKind.FORWARD: schedules.FORWARD,
        ActionKind.BACKWARD: schedules.BACKWARD_INPUT,
        ActionKind.WEIGHT: schedules.BACKWARD_WEIGHT,
    }
    placement = Placement.for_schedule(p, v, schedule)
    return {
        rank: [
            schedules._Action(placement.stage(rank, step[0].chunk), kinds[step[0].kind], step[0].microbatch)
            for step in build_schedule(p, v, m, rank, kind=schedule)
            if step[0].kind in kinds
        ]
        for rank in range(p)
    }


def round_order(names: list, round_index: int) -> list:
    """The runs of one timed round: the schedules rotated by one each round, each schedule's two runs
    back to back, and the side that runs first alternating between rounds. The first run of a pair
    follows another schedule's run, the second follows its twin; with a fixed order inside the pair
    that difference would count against one side in every round."""
    shift = round_index % len(names)
    sides = ("ours", "torch") if round_index % 2 == 0 else ("torch", "ours")
    return [(name, side) for name in names[shift:] + names[:shift] for side in sides]


def _stages_for(blocks: list, p: int, v: int, rank: int, schedule: str, build=copy.deepcopy) -> tuple[list, list]:
    """Fresh copies (`build(block)`) of the blocks of this rank's v chunks, each at its global stage
    (c*p + rank; under zbv the V placement's)."""
    per_stage = len(blocks) // (p * v)
    placement = Placement.for_schedule(p, v, schedule)
    indices = [placement.stage(rank, c) for c in range(v)]
    stages = [Stage([build(b) for b in blocks[i * per_stage : (i + 1) * per_stage]]) for i in indices]
    return stages, indices


def _max_rel_diff(a: list, b: list) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        scale = max(x.abs().max().item(), y.abs().max().item(), 1e-30)
        worst = max(worst, (x - y).abs().max().item() / scale)
    return worst


def worker(rank: int, args) -> dict:
    p, v, m = args.pp, args.vpp, args.microbatches
    mesh = ParallelMesh(ParallelDims(pp=p), "cpu")
    _TorchSpans.install()
    torch.manual_seed(args.seed)  # identical on every rank: every rank builds the same full model
    blocks = [torch_block(args.hidden, args.ffn) for _ in range(p * v * args.blocks_per_stage)]
    ours = functools.partial(our_block, tp_group=mesh.tp_group, fusion=args.gradient_accumulation_fusion)
    x = torch.randn(m, args.tokens, 1, args.hidden)
    labels = torch.randn(m, args.tokens, 1, args.hidden)
    data = (x, labels, torch.ones(args.tokens, 1))

    runs = {}
    for name in args.schedules:
        chunks = chunks_per_rank(name, v)
        runs[(name, "ours")] = Ours(_stages_for(blocks, p, chunks, rank, name, ours)[0], mesh, args, name)
        runs[(name, "torch")] = Theirs(*_stages_for(blocks, p, chunks, rank, name), mesh, args, name)

    # correctness: the same losses (last rank) and gradients (every rank) on both sides
    check = {}
    for name in args.schedules:
        ours, theirs = runs[(name, "ours")], runs[(name, "torch")]
        ours_loss, theirs_loss = ours.step(data), theirs.step(data)
        check[name] = {
            "ours_loss": ours_loss,
            "torch_loss": theirs_loss,
            "loss_diff": 0.0 if ours_loss is None else abs(ours_loss - theirs_loss) / max(abs(theirs_loss), 1e-30),
            "grad_diff": _max_rel_diff(ours.grads(), theirs.grads()),
        }

    # timing: warm-up, then rounds of all runs (round_order)
    order = list(runs)
    for _ in range(args.warmup):
        for key in order:
            runs[key].step(data)
    times = torch.zeros(len(order), args.iters, dtype=torch.float64)
    for it in range(args.iters):
        for key in round_order(args.schedules, it):
            dist.barrier(group=mesh.pp_group)
            start = CLOCKS[args.clock]()
            runs[key].step(data)
            times[order.index(key), it] = CLOCKS[args.clock]() - start
    # wall: a step lasts as long as its slowest rank; cpu: the step's work is every rank's CPU time
    dist.all_reduce(times, op=dist.ReduceOp.MAX if args.clock == "wall" else dist.ReduceOp.SUM, group=mesh.pp_group)
    spans = {key: runs[key].spans[-args.iters :] for key in order}
    gathered = [None] * p
    dist.all_gather_object(gathered, (check, spans), group=mesh.pp_group)
    return {
        "order": order,
        "times": times.tolist(),
        "checks": [c for c, _ in gathered],
        "spans": [s for _, s in gathered],
    }


# ----------------------------------------------------------------------------- command line


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _schedules(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TORCH_SCHEDULES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown schedule {unknown[0] if unknown else text!r} (valid: {', '.join(TORCH_SCHEDULES)})"
        )
    return list(dict.fromkeys(names))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--schedules",
        type=_schedules,
        default=["1f1b", "interleaved"],
        help=f"comma-separated schedules, each against torch's counterpart ({', '.join(TORCH_SCHEDULES)}; "
        "default 1f1b,interleaved)",
    )
    parser.add_argument(
        "--pp",
        type=_positive,
        nargs="+",
        default=[2, 4],
        help="pipeline ranks, one process each; one run per value (default 2 4; 1: one process, 1f1b "
        "only: the step's work without transfers)",
    )
    parser.add_argument(
        "--microbatches",
        type=_positive,
        nargs="+",
        default=[8, 16],
        help="microbatches per step; one run per value and --pp (default 8 16)",
    )
    parser.add_argument(
        "--vpp", type=_positive, default=2, help="model chunks per rank of the interleaved runs (default 2)"
    )
    parser.add_argument("--hidden", type=_positive, default=512, help="hidden size (default 512)")
    parser.add_argument("--ffn", type=_positive, default=None, help="MLP inner size (default 2 * hidden)")
    parser.add_argument("--tokens", type=_positive, default=256, help="tokens per microbatch (default 256)")
    parser.add_argument(
        "--blocks-per-stage",
        type=_positive,
        default=1,
        help="MLP blocks per interleaved stage; a 1F1B stage holds vpp times as many (default 1)",
    )
    parser.add_argument(
        "--gradient-accumulation-fusion",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ours: layers add weight gradients into main_grad (the trainer's default); "
        "--no-gradient-accumulation-fusion: a weight-gradient product added afterwards, "
        "as autograd does",
    )
    parser.add_argument(
        "--split-backward",
        action="store_true",
        help="ours, 1f1b and interleaved: weight gradients after the input gradient is sent (the trainer's "
        "--split-backward)",
    )
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall: step time of the slowest rank (default); cpu: CPU time of all ranks' processes "
        "(all threads) summed, the step's total work, which bounds the step when ranks outnumber "
        "cores; transport: the part of it outside the thread that runs the step (gloo's threads)",
    )
    parser.add_argument("--warmup", type=_positive, default=2, help="untimed steps of each run (default 2)")
    parser.add_argument(
        "--iters",
        type=_positive,
        default=30,
        help="timed steps (rounds) of each run (default 30: on a shared 2-core machine a run's median ratio "
        "over 10 rounds moved by up to 0.08 between runs of the same code)",
    )
    parser.add_argument("--quick", action="store_true", help="1 warm-up and 3 timed steps of each run")
    parser.add_argument("--trace", help="write the median step of every run as a measured timeline (JSON) here")
    parser.add_argument(
        "--json", help="write {schedule: {ours_over_torch, ours_ms, torch_ms, simulated_bubble}} here (one --pp, m)"
    )
    parser.add_argument("--seed", type=int, default=1234)
    return parser


def _validate(parser: argparse.ArgumentParser, args) -> None:
    if args.vpp < 2:
        parser.error(f"--vpp must be >= 2 for the interleaved schedules, got {args.vpp}")
    if "zbv" in args.schedules and args.vpp != 2:
        parser.error(f"--schedules zbv runs 2 model chunks per rank (V placement): --vpp must be 2, got {args.vpp}")
    if args.json and (len(args.pp) > 1 or len(args.microbatches) > 1):
        parser.error("--json needs one --pp and one --microbatches value")
    for p in args.pp:
        if p == 1 and args.schedules != ["1f1b"]:
            # one process: the step's work (executor, layers, loss, gradient buffers) without transfers
            parser.error(
                f"--pp 1 runs one process with --schedules 1f1b only, got --schedules {','.join(args.schedules)}"
            )
        for m in args.microbatches:
            if m < p:
                parser.error(f"--microbatches ({m}) must be >= --pp ({p})")
            if m % p:
                # ours needs groups of >= p microbatches; torch's ScheduleInterleaved1F1B groups them in rounds of
                # m // (m // p): only with m a multiple of p do both run the same schedule (groups of p)
                parser.error(
                    f"--microbatches ({m}) must be a multiple of --pp ({p}) so that both "
                    f"interleaved schedules run microbatches in groups of p"
                )
            try:
                for name in args.schedules:
                    for rank in range(p):
                        build_schedule(p, chunks_per_rank(name, args.vpp), m, rank, kind=name)
            except ValueError as error:
                parser.error(str(error))


def _spread(samples: list) -> str:
    return f"{min(samples) * 1e3:.0f}-{max(samples) * 1e3:.0f}"


def _paired(times: dict, name: str) -> list:
    return [a / b for a, b in zip(times[(name, "ours")], times[(name, "torch")])]


def breakdown(spans: list, times: list) -> dict:
    """Median over steps of one rank's milliseconds in compute, post, wait and the rest of the step."""
    parts = {"compute": [], "post": [], "wait": [], "other": []}
    for step, total in zip(spans, times):
        sums = {
            kind: sum(e - s for k, _, _, s, e in step if k in kinds)
            for kind, kinds in (("compute", COMPUTE_SPANS), ("post", ("post",)), ("wait", ("wait",)))
        }
        sums["other"] = total - sum(sums.values())
        for kind, value in sums.items():
            parts[kind].append(value * 1e3)
    return {kind: statistics.median(values) for kind, values in parts.items()}


def check_lines(result: dict, names: tuple) -> tuple[list, bool]:
    lines, ok = [], True
    for name in names:
        c = result["checks"][0 if name == "zbv" else -1][name]  # the rank of the last stage holds the losses
        grad = max(r[name]["grad_diff"] for r in result["checks"])
        good = c["loss_diff"] <= LOSS_RTOL and grad <= GRAD_RTOL
        ok &= good
        lines.append(
            f"  equal work, {name}: mean loss ours {c['ours_loss']:.6f} torch {c['torch_loss']:.6f} "
            f"(rel diff {c['loss_diff']:.1e}), grads max rel diff {grad:.1e} -> "
            f"{'match' if good else 'MISMATCH'}"
        )
    return lines, ok


def report(args, results: list) -> bool:
    """Print the checks and the tables; False when the two sides did not compute the same thing."""
    v, names = args.vpp, args.schedules
    print(
        f"pipeline benchmark: v={v}; residual MLP blocks (hidden {args.hidden}, ffn {args.ffn}), "
        f"{args.blocks_per_stage} per interleaved stage, {args.tokens} tokens/microbatch, fp32, CPU, gloo, "
        f"1 thread/rank; ours with{'' if args.gradient_accumulation_fusion else 'out'} gradient accumulation "
        f"fusion{', split backward' if args.split_backward else ''}; "
        f"{args.warmup} warm-up + {args.iters} timed steps each, alternating; "
        f"median of {MEASURES[args.clock]}"
    )
    ok = True
    for result in results:
        lines, good = check_lines(result, names)
        ok &= good
        print(
            f"p={result['p']} m={result['m']} ({result['p']} ranks on {os.cpu_count()} CPU cores), "
            f"1-minute load average before the run {result['load']:.1f}:"
        )
        print("\n".join(lines))
    if not ok:
        print("WARNING: the two implementations did not do the same computation; the timing below is not comparable")
    print()

    header = (
        f"{'p':>2} {'m':>3} {'schedule':<16} {'ours ms':>8} {'(min-max)':>10} {'torch ms':>8} {'(min-max)':>10} "
        f"{'ours/torch':>10} {'per-round':>9} {'bubble':>7}"
    )
    print(header)
    print("-" * len(header))
    pooled = {name: [] for name in names}
    for result in results:
        p, m = result["p"], result["m"]
        times = dict(zip(result["order"], result["times"]))
        med = {key: statistics.median(samples) for key, samples in times.items()}
        for name in names:
            ours, theirs = times[(name, "ours")], times[(name, "torch")]
            pooled[name] += _paired(times, name)
            print(
                f"{p:>2} {m:>3} {name:<16} {med[(name, 'ours')] * 1e3:>8.1f} {_spread(ours):>10} "
                f"{med[(name, 'torch')] * 1e3:>8.1f} {_spread(theirs):>10} "
                f"{med[(name, 'ours')] / med[(name, 'torch')]:>10.3f} "
                f"{statistics.median(_paired(times, name)):>9.3f} {simulated_bubble(name, p, v, m):>7.4f}"
            )
    print(
        "(per-round: median of ours/torch over rounds that run both back to back; bubble: our schedule's "
        "simulated idle / busy with F = 1, B = 2 (W = 1 of it in the zero-bubble ones), free transfers)"
    )
    print()
    if args.clock == "wall":
        _print_breakdown(results, names)
    ratios = ", ".join(f"{name} {statistics.median(pooled[name]):.3f}" for name in names)
    print(
        f"ours/torch {'step' if args.clock == 'wall' else 'CPU'} time (target <= 1.0), "
        f"over p={','.join(map(str, args.pp))} "
        f"m={','.join(map(str, args.microbatches))}: median of the per-round ratios "
        f"(each round runs both back to back): {ratios}"
    )
    return ok


def summary(args, result: dict) -> dict:
    """The --json record of one (p, m) run: per schedule, the medians and their per-round ratio."""
    times = dict(zip(result["order"], result["times"]))
    return {
        name: {
            "ours_over_torch": statistics.median(_paired(times, name)),
            "ours_ms": statistics.median(times[(name, "ours")]) * 1e3,
            "torch_ms": statistics.median(times[(name, "torch")]) * 1e3,
            "simulated_bubble": simulated_bubble(name, result["p"], args.vpp, result["m"]),
        }
        for name in args.schedules
    }


def _print_breakdown(results: list, names: tuple) -> None:
    header = (
        f"{'p':>2} {'m':>3} {'schedule':<16} {'side':<6} {'rank':>4} "
        f"{'compute':>8} {'post':>6} {'wait':>6} {'other':>6}"
    )
    print(
        "where each rank's step time goes, ms (median over the timed steps; other = step time of the slowest "
        "rank minus the rest)"
    )
    print(header)
    print("-" * len(header))
    for result in results:
        times = dict(zip(result["order"], result["times"]))
        for name in names:
            for side in ("ours", "torch"):
                for rank, rank_spans in enumerate(result["spans"]):
                    b = breakdown(rank_spans[(name, side)], times[(name, side)])
                    print(
                        f"{result['p']:>2} {result['m']:>3} {name:<16} {side:<6} {rank:>4} {b['compute']:>8.1f} "
                        f"{b['post']:>6.1f} {b['wait']:>6.1f} {b['other']:>6.1f}"
                    )
    print()


def trace(args, results: list) -> dict:
    """Every run's median step (by the slowest rank's time): each rank's spans, in seconds."""
    configs = []
    for result in results:
        runs = []
        for key, samples in zip(result["order"], result["times"]):
            step = sorted(range(len(samples)), key=samples.__getitem__)[len(samples) // 2]
            runs.append(
                {
                    "schedule": key[0],
                    "side": key[1],
                    "step_seconds": samples[step],
                    "ranks": [rank_spans[key][step] for rank_spans in result["spans"]],
                }
            )
        configs.append({"p": result["p"], "m": result["m"], "v": args.vpp, "load": result["load"], "runs": runs})
    return {"configs": configs}


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.iters = 1, 3
    args.ffn = args.ffn or 2 * args.hidden
    _validate(parser, args)
    results = []
    for p in args.pp:
        for m in args.microbatches:
            config = argparse.Namespace(**{**vars(args), "pp": p, "microbatches": m})
            load_before = os.getloadavg()[0]
            try:
                result = run_distributed(p, worker, config, timeout=900.0)[0]
            except (RuntimeError, AssertionError) as error:
                sys.exit(f"error: benchmark failed for p={p} m={m}: {error}")
            results.append({**result, "p": p, "m": m, "load": load_before})
    ok = report(args, results)
    if args.trace:
        Path(args.trace).write_text(json.dumps(trace(args, results)))
        print(f"wrote {args.trace}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary(args, results[0]), indent=1))
        print(f"wrote {args.json}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
