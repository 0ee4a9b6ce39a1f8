#!/usr/bin/env python
"""Pipeline schedules on CPU: our 1F1B vs interleaved, and ours vs torch.distributed.pipelining.

    python tools/bench/pipeline.py [--pp 2] [--microbatches 8] [--vpp 2] [--quick]

Launches --pp forked gloo ranks (one intra-op thread each) that hold a stack of
identical residual MLP blocks split into equal-cost stages: p stages for 1F1B,
p*v for the interleaved schedule (same blocks, same weights, same microbatches).
Each schedule runs through our PipelineExecutor (chunks wrapped in our
ModelChunkBuffers, as the executor requires) and through torch's
PipelineStage + Schedule1F1B / ScheduleInterleaved1F1B. Before timing, one step
of each checks that both produce the same losses and gradients: equal work is
the precondition for comparing time. Then the four runs alternate (warm-up
first, the order rotated each round); a step's time is the slowest rank's, and
the table shows medians next to the analytic bubble (p-1)/(v*m) and the
analytic time ratio interleaved/1F1B = (1 + (p-1)/(v*m)) / (1 + (p-1)/m),
which assumes free transfers. On CPU with gloo the transfers are not free, and
the interleaved schedule makes v times as many of them.
"""
from __future__ import annotations

import argparse
import copy
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
from megatron.core.pipeline_parallel.executor import PipelineExecutor, PipelineSpec  # noqa: E402
from megatron.core.pipeline_parallel.schedules import build_schedule  # noqa: E402
from megatron.core.pipeline_parallel.simulate import analytic_bubble_fraction  # noqa: E402
from megatron.testing.forked_ranks import run_distributed  # noqa: E402

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


# ----------------------------------------------------------------------------- model


class Block(torch.nn.Module):
    """x + W2 gelu(W1 x): every block costs the same."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Stage(torch.nn.Module):
    """Consecutive blocks. With labels (our last stage) it returns the per-token loss the executor
    expects; torch's last stage returns the output and its loss_fn computes the same mean."""

    def __init__(self, blocks: list):
        super().__init__()
        self.blocks = torch.nn.Sequential(*blocks)

    def forward(self, x, labels=None):
        y = self.blocks(x)
        if labels is None:
            return y
        return (y - labels).pow(2).mean(-1)


def torch_loss(output, target):
    return (output - target).pow(2).mean()


# ----------------------------------------------------------------------------- one rank


class Ours:
    def __init__(self, stages: list, mesh, args):
        self.chunks = [ModelChunkBuffers(s, DDPConfig(), mesh.dp_cp_group) for s in stages]
        spec = PipelineSpec(p2p_shape=(args.tokens, 1, args.hidden), p2p_dtype=torch.float32,
                            num_microbatches=args.microbatches)
        self.executor = PipelineExecutor(self.chunks, mesh, spec)
        self.last = mesh.is_last_stage
        self.idle = []

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
        self.idle.append(stats.idle_fraction)
        return (stats.loss_sum / stats.tokens).item() if self.last else None

    def grads(self) -> list:
        return [p.main_grad.clone() for c in self.chunks for p in c.module.parameters()]


class Theirs:
    def __init__(self, stages: list, stage_indices: list, mesh, args):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        self.modules = stages
        num_stages = args.pp * len(stages)
        self.stages = [PipelineStage(module, index, num_stages, torch.device("cpu"), group=mesh.pp_group)
                       for module, index in zip(stages, stage_indices)]
        self.first = any(s.is_first for s in self.stages)
        self.last = any(s.is_last for s in self.stages)
        if len(stages) == 1:
            self.schedule = Schedule1F1B(self.stages[0], args.microbatches, loss_fn=torch_loss)
        else:
            self.schedule = ScheduleInterleaved1F1B(self.stages, args.microbatches, loss_fn=torch_loss)

    def step(self, data) -> float | None:
        """Mean of the microbatch losses (last stage), else None."""
        x, labels, _ = data
        for module in self.modules:
            module.zero_grad(set_to_none=True)
        losses = [] if self.last else None
        # the whole batch, split by the schedule along dim 0 into the same [s, 1, h] microbatches
        inputs = (x.flatten(0, 1),) if self.first else ()
        target = labels.flatten(0, 1) if self.last else None
        self.schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        return sum(loss.item() for loss in losses) / len(losses) if self.last else None

    def grads(self) -> list:
        return [p.grad.detach().clone() for m in self.modules for p in m.parameters()]


def _stages_for(blocks: list, p: int, v: int, rank: int) -> tuple[list, list]:
    """Fresh copies of the blocks of this rank's v chunks; chunk c is global stage c*p + rank."""
    per_stage = len(blocks) // (p * v)
    indices = [c * p + rank for c in range(v)]
    stages = [Stage(copy.deepcopy(blocks[i * per_stage:(i + 1) * per_stage])) for i in indices]
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
    torch.manual_seed(args.seed)  # identical on every rank: every rank builds the same full model
    blocks = [Block(args.hidden, args.ffn) for _ in range(p * v * args.blocks_per_stage)]
    x = torch.randn(m, args.tokens, 1, args.hidden)
    labels = torch.randn(m, args.tokens, 1, args.hidden)
    data = (x, labels, torch.ones(args.tokens, 1))

    runs = {}
    for name, chunks in (("1F1B", 1), (f"interleaved v={v}", v)):
        runs[(name, "ours")] = Ours(_stages_for(blocks, p, chunks, rank)[0], mesh, args)
        runs[(name, "torch")] = Theirs(*_stages_for(blocks, p, chunks, rank), mesh, args)

    # correctness: the same losses (last rank) and gradients (every rank) on both sides
    check = {}
    for name in ("1F1B", f"interleaved v={v}"):
        ours, theirs = runs[(name, "ours")], runs[(name, "torch")]
        ours_loss, theirs_loss = ours.step(data), theirs.step(data)
        check[name] = {"ours_loss": ours_loss, "torch_loss": theirs_loss,
                       "loss_diff": 0.0 if ours_loss is None else abs(ours_loss - theirs_loss) / max(abs(theirs_loss), 1e-30),
                       "grad_diff": _max_rel_diff(ours.grads(), theirs.grads())}

    # timing: warm-up, then rounds of the four runs in rotating order
    order = list(runs)
    for _ in range(args.warmup):
        for key in order:
            runs[key].step(data)
    times = torch.zeros(len(order), args.iters, dtype=torch.float64)
    for it in range(args.iters):
        shift = it % len(order)
        for key in order[shift:] + order[:shift]:
            dist.barrier(group=mesh.pp_group)
            start = time.perf_counter()
            runs[key].step(data)
            times[order.index(key), it] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=mesh.pp_group)  # a step lasts as long as its slowest rank
    idle = {name: statistics.median(runs[(name, "ours")].idle[-args.iters:]) for name, side in order if side == "ours"}
    gathered = [None] * p
    dist.all_gather_object(gathered, (check, idle), group=mesh.pp_group)
    return {"order": order, "times": times.tolist(), "checks": [c for c, _ in gathered],
            "idle": [i for _, i in gathered]}


# ----------------------------------------------------------------------------- command line


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=_positive, default=2, help="pipeline ranks, one process each (default 2)")
    parser.add_argument("--microbatches", type=_positive, default=8, help="microbatches per step (default 8)")
    parser.add_argument("--vpp", type=_positive, default=2, help="model chunks per rank of the interleaved run (default 2)")
    parser.add_argument("--hidden", type=_positive, default=512, help="hidden size (default 512)")
    parser.add_argument("--ffn", type=_positive, default=None, help="MLP inner size (default 2 * hidden)")
    parser.add_argument("--tokens", type=_positive, default=256, help="tokens per microbatch (default 256)")
    parser.add_argument("--blocks-per-stage", type=_positive, default=1,
                        help="MLP blocks per interleaved stage; a 1F1B stage holds vpp times as many (default 1)")
    parser.add_argument("--warmup", type=_positive, default=2, help="untimed steps of each run (default 2)")
    parser.add_argument("--iters", type=_positive, default=10, help="timed steps of each run (default 10)")
    parser.add_argument("--quick", action="store_true", help="1 warm-up and 3 timed steps of each run")
    parser.add_argument("--seed", type=int, default=1234)
    return parser


def _validate(parser: argparse.ArgumentParser, args) -> None:
    if args.pp < 2:
        parser.error(f"--pp must be >= 2 to have a pipeline, got {args.pp}")
    if args.vpp < 2:
        parser.error(f"--vpp must be >= 2 to compare the interleaved schedule with 1F1B, got {args.vpp}")
    if args.microbatches < args.pp:
        parser.error(f"--microbatches ({args.microbatches}) must be >= --pp ({args.pp})")
    if args.microbatches % args.pp:
        # ours needs groups of >= p microbatches; torch's ScheduleInterleaved1F1B groups them in rounds of
        # m // (m // p): only with m a multiple of p do both run the same schedule (groups of p)
        parser.error(f"--microbatches ({args.microbatches}) must be a multiple of --pp ({args.pp}) so that both "
                     f"interleaved schedules run microbatches in groups of p")
    try:
        for rank in range(args.pp):
            build_schedule(args.pp, args.vpp, args.microbatches, rank)
    except ValueError as error:
        parser.error(str(error))


def _median_ms(samples: list) -> float:
    return statistics.median(samples) * 1e3


def _spread(samples: list) -> str:
    return f"{min(samples) * 1e3:.0f}-{max(samples) * 1e3:.0f}"


def _paired(times: dict, name: str) -> float:
    return statistics.median(a / b for a, b in zip(times[(name, "ours")], times[(name, "torch")]))


def report(args, result: dict) -> bool:
    """Print the checks and the table; False when the two sides did not compute the same thing."""
    p, v, m = args.pp, args.vpp, args.microbatches
    one, inter = "1F1B", f"interleaved v={v}"
    print(f"pipeline benchmark: p={p} m={m} v={v}; {p * v * args.blocks_per_stage} residual MLP blocks "
          f"(hidden {args.hidden}, ffn {args.ffn}), {args.tokens} tokens/microbatch, fp32, CPU, gloo, "
          f"1 thread/rank; {args.warmup} warm-up + {args.iters} timed steps each, alternating; "
          f"median of the slowest rank's step time")
    print(f"{os.cpu_count()} CPU cores for {p} ranks; 1-minute load average before the run {result['load']:.1f} "
          f"(other processes on the cores: well above 0 means expect noise)")
    print()
    ok = True
    for name in (one, inter):
        c = result["checks"][-1][name]  # the last rank holds the losses
        grad = max(r[name]["grad_diff"] for r in result["checks"])
        good = c["loss_diff"] <= LOSS_RTOL and grad <= GRAD_RTOL
        ok &= good
        print(f"equal work, {name}: mean loss ours {c['ours_loss']:.6f} torch {c['torch_loss']:.6f} "
              f"(rel diff {c['loss_diff']:.1e}), grads max rel diff {grad:.1e} -> "
              f"{'match' if good else 'MISMATCH'}")
    if not ok:
        print("WARNING: the two implementations did not do the same computation; the timing below is not comparable")
    print()

    times = {key: samples for key, samples in zip(result["order"], result["times"])}
    med = {key: _median_ms(samples) for key, samples in times.items()}
    bubble = {one: analytic_bubble_fraction(p, 1, m), inter: analytic_bubble_fraction(p, v, m)}
    header = (f"{'schedule':<16} {'ours ms':>9} {'(min-max)':>11} {'torch ms':>9} {'(min-max)':>11} "
              f"{'ours/torch':>10} {'bubble (p-1)/(vm)':>18}  ours idle per rank")
    print(header)
    print("-" * len(header))
    for name in (one, inter):
        ours, theirs = times[(name, "ours")], times[(name, "torch")]
        print(f"{name:<16} {med[(name, 'ours')]:>9.1f} {_spread(ours):>11} {med[(name, 'torch')]:>9.1f} "
              f"{_spread(theirs):>11} {med[(name, 'ours')] / med[(name, 'torch')]:>10.3f} {bubble[name]:>18.4f} "
              f" {' '.join(f'{i[name]:.0%}' for i in result['idle'])}")
    print()
    analytic = (1 + bubble[inter]) / (1 + bubble[one])
    print(f"interleaved/1F1B step time: analytic {analytic:.3f} = (1 + (p-1)/(v*m)) / (1 + (p-1)/m), "
          f"measured ours {med[(inter, 'ours')] / med[(one, 'ours')]:.3f}, "
          f"torch {med[(inter, 'torch')] / med[(one, 'torch')]:.3f}")
    print(f"ours/torch step time (target <= 1.0): 1F1B {med[(one, 'ours')] / med[(one, 'torch')]:.3f}, "
          f"{inter} {med[(inter, 'ours')] / med[(inter, 'torch')]:.3f}; median of the per-round ratios "
          f"(each round runs both back to back): 1F1B {_paired(times, one):.3f}, {inter} {_paired(times, inter):.3f}")
    print("(ours idle: median fraction of each rank's step that our executor spends in transfer steps, "
          "i.e. bubble plus gloo p2p time)")
    return ok


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.iters = 1, 3
    args.ffn = args.ffn or 2 * args.hidden
    _validate(parser, args)
    load_before = os.getloadavg()[0]
    try:
        result = run_distributed(args.pp, worker, args, timeout=900.0)[0]
    except RuntimeError as error:
        sys.exit(f"error: benchmark failed: {error}")
    result["load"] = load_before
    if not report(args, result):
        sys.exit(1)


if __name__ == "__main__":
    main()
