"""Preemption under a real SLURM (tools: ../shared/tools/local_slurm.sh starts one; .ci/run does).

examples/train_tiny_cpu_slurm.sbatch is submitted twice: once left alone, once requeued by
`scontrol requeue` mid-run. The requeue sends SIGTERM to the ranks, which finish the iteration,
save (--exit-signal-handler) and exit; SLURM starts the job again, it resumes from --load and
ends with the losses and grad norms (as logged) of the uninterrupted job, every iteration.
(The bit-for-bit check of resumed training is tests/parallel/test_checkpoint_resume.py.)
"""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_tiny_cpu_slurm.sbatch"
ITERATIONS = 200
FLAGS = ["--train-iters", str(ITERATIONS), "--save-interval", "1000"]  # the signal's save is the only one mid-run
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*lm loss: (\S+) \|.*grad norm: (\S+) \|")


def _cluster_problem() -> str | None:
    """Why no job can run here (None: a SLURM node is up)."""
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH (start a local cluster: bash ../shared/tools/local_slurm.sh, as root)"
    nodes = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    if nodes.returncode or not re.search(r"idle|mix|alloc", nodes.stdout):
        return f"no SLURM node is up (sinfo: {(nodes.stdout + nodes.stderr).strip()[:200] or 'no nodes'})"
    return None


pytestmark = pytest.mark.skipif(_cluster_problem() is not None, reason=str(_cluster_problem()))


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True, timeout=30).stdout


def _job(job: str) -> dict:
    fields = _scontrol("show", "job", "-o", job).split()
    return dict(field.split("=", 1) for field in fields if "=" in field)


def _wait(what: str, condition, timeout: float = 600.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _submit(tmp_path: Path, name: str) -> tuple[str, Path]:
    log = tmp_path / f"{name}.out"
    env_ckpt = f"ALL,CKPT={tmp_path / name}"
    job = subprocess.run(["sbatch", "--parsable", f"--job-name={name}", f"--output={log}", f"--export={env_ckpt}",
                          str(SCRIPT), *FLAGS], capture_output=True, text=True, check=True, cwd=ROOT,
                         timeout=60).stdout.strip().split(";")[0]
    return job, log


def _finished(job: str, log: Path) -> bool:
    state = _job(job)["JobState"]
    if state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
        raise AssertionError(f"job {job} {state}; log:\n{log.read_text()[-3000:] if log.exists() else '(none)'}")
    return state == "COMPLETED"


def _metrics(log: Path) -> dict[int, tuple[str, str]]:
    """Iteration -> (lm loss, grad norm) as logged; a repeated iteration keeps its last line."""
    return {int(m[1]): (m[2], m[3]) for m in LINE.finditer(log.read_text())}


def _logged(log: Path, pattern: str) -> bool:
    return log.exists() and re.search(pattern, log.read_text()) is not None


def test_requeued_job_resumes_with_the_losses_of_an_uninterrupted_job(tmp_path):
    jobs = []
    try:
        reference, reference_log = _submit(tmp_path, "reference")
        jobs.append(reference)
        preempted, log = _submit(tmp_path, "preempted")
        jobs.append(preempted)
        _wait("iteration 10 of the job to preempt", lambda: _logged(log, r"iteration\s+10/"))
        _scontrol("requeue", preempted)
        _wait("the requeued job to be pending", lambda: _job(preempted)["JobState"] == "PENDING")
        _scontrol("update", f"JobId={preempted}", "StartTime=now")  # skip SLURM's delay before a requeued job starts
        _wait("both jobs to complete", lambda: _finished(preempted, log) and _finished(reference, reference_log))
    finally:
        subprocess.run(["scancel", *jobs], capture_output=True, timeout=30)
    text = log.read_text()
    stop = re.search(r"> exiting after iteration (\d+): SIGTERM received", text)
    assert stop, text[-3000:]
    assert _job(preempted)["Restarts"] == "1"
    assert f"(iteration {stop[1]})" in text and "restart 1" in text, text[-3000:]
    assert int(stop[1]) < ITERATIONS
    expected, resumed = _metrics(reference_log), _metrics(log)
    assert sorted(expected) == sorted(resumed) == list(range(1, ITERATIONS + 1))
    assert resumed == expected  # every line, the resumed run's first ones included
