"""Zero-bubble schedules as data: ZB-H1's bubble from the paper, deferred weight steps in microbatch
order, the same forwards, backwards and transfers as the schedule they defer, and one-line refusals."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.core.pipeline_parallel.schedules import ActionKind, build_schedule
from megatron.planning.pipeline_simulator import peak_in_flight, simulate_steps
from megatron.training.arguments.parser import LLAMA_DEFAULTS, parse_run_config

REPO = Path(__file__).resolve().parents[2]
F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
# (forward, input-gradient, weight-gradient) times: equal ones as the paper draws them, and unequal ones
TIMES = [(1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.5, 1.0, 1.0), (1.0, 1.0, 0.25)]
PM = [(2, 2), (2, 4), (3, 9), (4, 4), (4, 8), (8, 8), (8, 16)]


def idle_per_rank(kind, p, v, m, times):
    f, b, w = times
    lists = [build_schedule(p, v, m, r, kind=kind) for r in range(p)]
    timeline = simulate_steps(lists, v, forward_time=f, backward_time=b + w, weight_time=w)
    return timeline.makespan - v * m * (f + b + w)


@pytest.mark.parametrize("times", TIMES)
@pytest.mark.parametrize("p,m", PM)
def test_zb_h1_idle_time_is_the_papers(p, m, times):
    """Qi et al. (ICLR 2024): ZB-H1 leaves each rank (p-1)(F+B-W) idle, 1F1B (p-1)(F+B+W)."""
    f, b, w = times
    assert idle_per_rank("zb-h1", p, 1, m, times) == pytest.approx((p - 1) * (f + b - w))
    assert idle_per_rank("1f1b", p, 1, m, times) == pytest.approx((p - 1) * (f + b + w))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12)])
def test_interleaved_zb_idle_time_matches_zb_h1_at_equal_times(p, m):
    """At equal F, B, W and m >= 2p the interleaved schedule with deferred W reaches ZB-H1's idle
    time per rank, (p-1) units, against the interleaved schedule's 3(p-1) (docs/pipeline.md
    gives the cases where it does not: m = p, p = 8)."""
    assert idle_per_rank("interleaved-zb", p, 2, m, (1.0, 1.0, 1.0)) == pytest.approx(p - 1)
    assert idle_per_rank("interleaved", p, 2, m, (1.0, 1.0, 1.0)) == pytest.approx(3 * (p - 1))


@pytest.mark.parametrize("kind,v", [("zb-h1", 1), ("interleaved-zb", 2)])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4)])
def test_deferral_moves_only_weight_steps_in_microbatch_order(kind, v, p, m):
    base = "1f1b" if v == 1 else "interleaved"
    for rank in range(p):
        steps = build_schedule(p, v, m, rank, kind=kind)
        split = build_schedule(p, v, m, rank, kind=base, split_backward=True)
        assert [s for s in steps if s[0].kind is not W] == [s for s in split if s[0].kind is not W]
        assert peak_in_flight(steps) == peak_in_flight(split)  # the same activation memory
        backward_done, pending, most = set(), [], 0
        for step in steps:
            action = step[0]
            if action.kind is B:
                backward_done.add((action.microbatch, action.chunk))
                pending.append((action.microbatch, action.chunk))
                most = max(most, len(pending))
            elif action.kind is W:
                unit = (action.microbatch, action.chunk)
                assert unit in backward_done, f"rank {rank}: W{unit} before its backward"
                oldest_of_chunk = next(u for u in pending if u[1] == action.chunk)
                assert unit == oldest_of_chunk, f"rank {rank}: W{unit} out of microbatch order"
                pending.remove(unit)
        assert not pending, f"rank {rank}: weight steps never run: {pending}"
        allowed = rank if kind == "zb-h1" else 2 * rank
        assert most <= allowed + 1


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--pipeline-schedule", "zbv"], "--pipeline-schedule zbv needs --pipeline-model-parallel-size > 1"),
        (["--pipeline-schedule", "zb-h1"], "--pipeline-schedule zb-h1 needs --pipeline-model-parallel-size > 1"),
        (
            ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved-zb"],
            "--pipeline-schedule interleaved-zb runs several model chunks per rank: give "
            "--num-layers-per-virtual-pipeline-stage",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
            + ["--pipeline-schedule", "zb-h1"],
            "use --pipeline-schedule interleaved-zb",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
            + ["--pipeline-schedule", "1f1b"],
            "use --pipeline-schedule interleaved",
        ),
        (["--pipeline-schedule", "gpipe"], "invalid choice: 'gpipe'"),
    ],
)
def test_bad_schedule_flags_are_one_line(flags, message):
    argv = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
    argv += ["--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "1", "--mock-data"]
    argv += ["--vocab-size", "64"]
    world = 2 if "--pipeline-model-parallel-size" in flags else 1
    with pytest.raises(ValueError) as info:
        parse_run_config(argv + flags, LLAMA_DEFAULTS, world)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_too_few_microbatches_for_interleaved_zb_name_the_flags():
    with pytest.raises(ValueError, match="at least as many microbatches as pipeline stages.*--global-batch-size"):
        build_schedule(4, 2, 3, 0, kind="interleaved-zb")


def test_benchmark_runs_every_schedule_against_torch_with_equal_work(tmp_path):
    """tools/bench/pipeline.py: each schedule through our executor and torch.distributed.pipelining's
    counterpart (zb-h1: torch's runtime fed our compute order) computes the same losses and gradients
    before anything is timed (zbv in the V placement on both sides), and --json has the documented record."""
    out = tmp_path / "pipeline.json"
    flags = ["--pp", "2", "--microbatches", "4", "--hidden", "32", "--tokens", "8", "--quick"]
    flags += ["--schedules", "1f1b,zb-h1,zbv,interleaved-zb", "--json", str(out)]
    result = subprocess.run(
        [sys.executable, str(REPO / "tools/bench/pipeline.py"), *flags], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    for name in ("1f1b", "zb-h1", "zbv", "interleaved-zb"):
        assert re.search(rf"equal work, {name}: .* -> match", result.stdout), result.stdout
    record = json.loads(out.read_text())
    assert set(record) == {"1f1b", "zb-h1", "zbv", "interleaved-zb"}
    assert all(set(r) == {"ours_over_torch", "ours_ms", "torch_ms", "simulated_bubble"} for r in record.values())
    assert record["zbv"]["simulated_bubble"] < record["zb-h1"]["simulated_bubble"] < record["1f1b"]["simulated_bubble"]
    refused = subprocess.run(
        [sys.executable, str(REPO / "tools/bench/pipeline.py"), "--schedules", "zbv", "--vpp", "3"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "--schedules zbv runs 2 model chunks per rank" in refused.stderr


def test_benchmark_one_process_times_the_step_work_of_1f1b_only():
    """--pp 1: both sides' whole step (executor or torch's schedule, layers, loss, gradients) in one
    process without transfers, after the same equal-work check; the other schedules need a pipeline."""
    bench = [sys.executable, str(REPO / "tools/bench/pipeline.py"), "--pp", "1"]
    small = ["--microbatches", "4", "--hidden", "32", "--tokens", "8", "--quick"]
    result = subprocess.run([*bench, *small, "--schedules", "1f1b"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert re.search(r"equal work, 1f1b: .* -> match", result.stdout), result.stdout
    assert re.search(r"^ 1   4 1f1b ", result.stdout, re.MULTILINE), result.stdout
    refused = subprocess.run([*bench, "--schedules", "1f1b,zbv"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--pp 1 runs one process with --schedules 1f1b only" in refused.stderr
