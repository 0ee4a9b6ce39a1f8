"""Preemption under a real SLURM (../shared/tools/local_slurm_nodes.sh start 2 starts one; .ci/run does).

examples/train_tiny_cpu_slurm.sbatch is submitted twice: once left alone, once requeued by
`scontrol requeue` mid-run. The requeue sends SIGTERM to the ranks, which finish the iteration,
save (--exit-signal-handler) and exit; SLURM starts the job again, it resumes from --load and
ends with the losses and grad norms (as logged) of the uninterrupted job, every iteration.
(The bit-for-bit check of resumed training is tests/parallel/test_checkpoint_resume.py.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.slurm import cluster

ITERATIONS = 200
FLAGS = ["--train-iters", str(ITERATIONS), "--save-interval", "1000"]  # the signal's save is the only one mid-run

pytestmark = pytest.mark.skipif(cluster.cluster_problem() is not None, reason=str(cluster.cluster_problem()))


def _submit(tmp_path: Path, name: str) -> tuple[str, Path]:
    log = tmp_path / f"{name}.out"
    return cluster.submit(
        "train_tiny_cpu_slurm.sbatch", log, [f"--job-name={name}"], {"CKPT": tmp_path / name}, FLAGS
    ), log


def test_requeued_job_resumes_with_the_losses_of_an_uninterrupted_job(tmp_path):
    jobs = []
    try:
        reference, reference_log = _submit(tmp_path, "reference")
        jobs.append(reference)
        preempted, log = _submit(tmp_path, "preempted")
        jobs.append(preempted)
        cluster.wait_for("iteration 10 of the job to preempt", lambda: cluster.logged(log, r"iteration\s+10/"))
        cluster.scontrol("requeue", preempted)
        cluster.release(preempted)  # skip SLURM's delay before a requeued job starts
        cluster.wait_for(
            "both jobs to complete",
            lambda: cluster.finished(preempted, log) and cluster.finished(reference, reference_log),
        )
    finally:
        cluster.cancel(*jobs)
    text = log.read_text()
    stop = re.search(r"> exiting after iteration (\d+): SIGTERM received", text)
    assert stop, text[-3000:]
    assert cluster.job_fields(preempted)["Restarts"] == "1"
    assert f"(iteration {stop[1]})" in text and "restart 1" in text, text[-3000:]
    assert int(stop[1]) < ITERATIONS
    expected, resumed = cluster.metrics(reference_log), cluster.metrics(log)
    assert sorted(expected) == sorted(resumed) == list(range(1, ITERATIONS + 1))
    assert resumed == expected  # every line, the resumed run's first ones included
