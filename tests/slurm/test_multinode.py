"""Two SLURM nodes x two ranks (../shared/tools/local_slurm_nodes.sh start 2): launch and failures.

- examples/train_tiny_cpu_slurm.sbatch (one srun task per rank) and examples/llama_slurm.sbatch
  (srun + one torchrun per node, with its CPU overrides) print the one-process losses (TP2 x DP2).
- The llama script with TORCHRUN_ARGS="--max-restarts 1": a worker SIGKILLed mid-run; torchrun
  restarts the workers of both nodes, they resume from the latest checkpoint and the job completes
  with the uninterrupted losses from the restored iteration on.
- kill-node node2 --hard (power loss): every surviving rank exits within the heartbeat bound,
  measured from the kill (SlurmdTimeout, 30 s, is longer, so this is the trainer's detection), with
  a line naming a node2 rank; the job requeues itself, resumes from the last checkpoint and ends
  with the uninterrupted run's losses. kill-node node2 (soft): every surviving rank exits within the
  bound too.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.cli import printed_losses, run_cli
from tests.slurm import cluster

HEARTBEAT = 5.0
BOUND = 1.6 * HEARTBEAT + 2.0  # heartbeat.py's bound (timeout + 3 periods) + the processes' exit
ITERATIONS = 30
SAVE = 5
KILL_AFTER = 7  # iterations logged before the failure: a checkpoint (SAVE) exists, most of the run remains
MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--ffn-hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--seq-length",
    "16",
    "--vocab-size",
    "256",
]
TRAINING = [
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    str(ITERATIONS),
    "--log-interval",
    "1",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--lr-warmup-iters",
    "1",
    "--lr-decay-style",
    "cosine",
    "--weight-decay",
    "0.1",
    "--adam-beta2",
    "0.95",
    "--clip-grad",
    "1.0",
    "--eval-iters",
    "0",
    "--save-interval",
    str(SAVE),
    "--heartbeat-timeout-seconds",
    str(HEARTBEAT),
]
TP2 = ["--tensor-model-parallel-size", "2"]
TWO_NODES = ["-N2", "--ntasks-per-node=2"]
JOB_ENV = {"STEP_EXIT_GRACE": "2", "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.skipif(cluster.cluster_problem(2) is not None, reason=str(cluster.cluster_problem(2)))
needs_node_failures = pytest.mark.skipif(
    cluster.node_failure_problem() is not None, reason=str(cluster.node_failure_problem())
)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[float]:
    save = str(tmp_path_factory.mktemp("one_process"))
    run = run_cli("pretrain_llama.py", MODEL + TRAINING + ["--mock-data", "--save", save])
    assert run.returncode == 0, run.stderr[-3000:]
    return printed_losses(run.stdout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, tuple[str, str]]:
    """The CPU sbatch on two nodes, left alone: the reference of the failure tests."""
    out = tmp_path_factory.mktemp("uninterrupted")
    log = out / "job.out"
    job = cluster.submit(
        "train_tiny_cpu_slurm.sbatch", log, TWO_NODES, {**JOB_ENV, "CKPT": out / "ckpt"}, MODEL + TRAINING + TP2
    )
    try:
        cluster.wait_for("the two-node job", lambda: cluster.finished(job, log))
    finally:
        cluster.cancel(job)
    assert "TP=2 CP=1 DP=2 PP=1 (world size 4" in log.read_text()
    return cluster.metrics(log)


def _close_to(logged: dict[int, float], expected: dict[int, float]) -> None:
    """TP2 x DP2 sums in another order than one process: the 7th digit may differ."""
    assert sorted(logged) == sorted(expected)
    bad = {k: (logged[k], expected[k]) for k in expected if abs(logged[k] - expected[k]) > 2e-6 * abs(expected[k])}
    assert not bad, f"iteration: (logged, expected) {bad}"


def _as_losses(metrics: dict[int, tuple[str, str]]) -> dict[int, float]:
    return {k: float(loss) for k, (loss, _) in metrics.items()}


def test_cpu_sbatch_on_two_nodes_prints_the_one_process_losses(uninterrupted, one_process):
    assert len(one_process) == ITERATIONS
    _close_to(_as_losses(uninterrupted), dict(enumerate(one_process, start=1)))


def _kill_last_rank(ckpt: Path) -> None:
    os.kill(max(cluster.rank_pids(str(ckpt)), key=lambda pid: cluster.rank_of(pid) or -1), signal.SIGKILL)


def test_torchrun_script_on_two_nodes_restarts_a_killed_rank(tmp_path, one_process):
    """The GPU script, CPU overrides, --max-restarts 1: one worker SIGKILLed after a checkpoint."""
    log, ckpt = tmp_path / "job.out", tmp_path / "ckpt"
    env = {
        **JOB_ENV,
        "CKPT": ckpt,
        "GPUS_PER_NODE": "2",
        "BACKEND": "gloo",
        "PRECISION": "",
        "PARALLEL": " ".join(TP2),
        "MODEL": " ".join(MODEL),
        "TORCHRUN_ARGS": "--max-restarts 1",
    }
    job = cluster.submit("llama_slurm.sbatch", log, ["-N2", "--gpus-per-node=0", "--cpus-per-task=1"], env, TRAINING)
    try:
        cluster.fail_mid_run(log, ckpt, KILL_AFTER, lambda: _kill_last_rank(ckpt))
        cluster.wait_for("the job to complete", lambda: cluster.finished(job, log))
        assert cluster.job_fields(job)["Restarts"] == "0", "healed by a SLURM requeue, not by torchrun"
    finally:
        cluster.cancel(job)
    text = log.read_text()
    restored = cluster.restored_iterations(text)
    assert len(restored) == 1 and restored[0] >= SAVE, cluster.log_tail(log)
    reference = {k: (str(loss), "") for k, loss in enumerate(one_process, start=1)}
    resumed = {k: v for k, v in _as_losses(cluster.metrics(log)).items() if k > restored[0]}
    _close_to(resumed, cluster.expected_after_resume(reference, restored[0] + 1))
    # and before the failure the script printed the one-process losses too
    first_run = _as_losses(cluster.metrics_of(text[: text.index("> loaded")]))
    _close_to(
        {k: v for k, v in first_run.items() if k <= restored[0]},
        {k: one_process[k - 1] for k in first_run if k <= restored[0]},
    )


def _kill_node_mid_run(tmp_path, hard: bool) -> tuple[str, Path, float, list[int], str]:
    """Submit the CPU sbatch on two nodes, kill node2 after KILL_AFTER iterations; returns the job,
    its log, the seconds from the kill until every surviving rank had exited, their pids, and what
    the survivors' threads were waiting in when the bound had passed (for the failure message)."""
    log, ckpt = tmp_path / "job.out", tmp_path / "ckpt"
    job = cluster.submit(
        "train_tiny_cpu_slurm.sbatch", log, TWO_NODES, {**JOB_ENV, "CKPT": ckpt}, MODEL + TRAINING + TP2
    )
    kill = ["kill-node", "node2"] + (["--hard"] if hard else [])
    _, seconds, survivors, late = cluster.fail_mid_run(
        log, ckpt, KILL_AFTER, lambda: cluster.nodes_tool(*kill), snapshot_after=BOUND
    )
    return job, log, seconds, survivors, late


def _exited_within_the_bound(log: Path, seconds: float, survivors: list[int], late: str, hard: bool) -> None:
    """After a power loss both node1 ranks are alive right after the kill (they learn of it only by
    the heartbeat); after a soft kill one may already be gone (it saw the reset, raised and exited)."""
    assert len(survivors) == 2 if hard else len(survivors) <= 2, survivors
    assert seconds <= BOUND, (
        f"survivors exited {seconds:.1f} s after the kill (bound {BOUND} s); their threads at the bound:\n"
        f"{late}\nthe job's log:\n{cluster.log_tail(log)}"
    )


def _resume_and_finish(job: str, log, uninterrupted) -> None:
    cluster.nodes_tool("start", "2")
    cluster.release(job)
    cluster.wait_for("the requeued job to complete", lambda: cluster.finished(job, log))
    text = log.read_text()
    assert "restart 1" in text, cluster.log_tail(log)
    restored = cluster.restored_iterations(text)
    assert len(restored) == 1 and SAVE <= restored[0] < ITERATIONS, cluster.log_tail(log)
    resumed = {k: v for k, v in _as_losses(cluster.metrics(log)).items() if k > restored[0]}
    expected = cluster.expected_after_resume(uninterrupted, restored[0] + 1)
    assert resumed == pytest.approx(expected, rel=1e-6, abs=0)
    assert cluster.metrics(log)[ITERATIONS] == uninterrupted[ITERATIONS]


@needs_node_failures
def test_hard_node_failure_ends_the_survivors_within_the_heartbeat_bound_then_heals(tmp_path, uninterrupted):
    job = None
    try:
        job, log, *exit = _kill_node_mid_run(tmp_path, hard=True)
        _exited_within_the_bound(log, *exit, hard=True)
        assert re.search(r"error: heartbeat: rank \d \(node1\) exits: .*rank [23] \(node2", log.read_text()), (
            cluster.log_tail(log)
        )
        _resume_and_finish(job, log, uninterrupted)
    finally:
        cluster.nodes_tool("start", "2")
        if job:
            cluster.cancel(job)


@needs_node_failures
def test_soft_node_failure_ends_the_survivors_within_the_heartbeat_bound(tmp_path):
    """The surviving ranks see a reset connection at once; the heartbeat makes them all exit. The
    requeue and resume after it are the hard failure's (the same SLURM path), not run again here."""
    job = None
    try:
        job, log, *exit = _kill_node_mid_run(tmp_path, hard=False)
        _exited_within_the_bound(log, *exit, hard=False)
    finally:
        cluster.nodes_tool("start", "2")
        if job:
            cluster.cancel(job)
