"""Failures on a real two-node SLURM (../shared/tools/local_slurm_nodes.sh start 2, as root):
how fast a job notices, ends and heals.

    python tools/bench/node_failure.py [--scenarios torchrun soft hard hard-no-heartbeat]

Each scenario is tests/slurm/test_multinode.py's job (TP2 x DP2 over two nodes x two ranks, a
tiny Llama, a checkpoint every 5 iterations, --heartbeat-timeout-seconds 5), failed once after
iteration 7 is logged:
  torchrun            a worker SIGKILLed in examples/llama_slurm.sbatch with TORCHRUN_ARGS="--max-restarts 1"
  soft / hard         `kill-node node2` (processes killed: peers see a reset) / `--hard` (link cut first:
                      peers see nothing) in examples/train_tiny_cpu_slurm.sbatch, healed by the job's requeue
  hard-no-heartbeat   as hard with --heartbeat-timeout-seconds 0: the survivors wait until SLURM ends them
Printed, from the kill: seconds until every surviving rank had exited, until the requeued job's
batch script started (whole seconds), until the resumed run logged its first iteration, and the
iterations lost (done before the failure, done again after it).
A requeued job is started at once (`scontrol update StartTime=now`; SLURM would hold it ~2 min)
and node2 is revived (`start 2`) as soon as the survivors have exited: a real cluster would place
the job on a spare node instead.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.slurm import cluster  # noqa: E402
from tests.slurm.test_multinode import (  # noqa: E402
    JOB_ENV,
    KILL_AFTER,
    MODEL,
    TP2,
    TRAINING,
    TWO_NODES,
    _kill_last_rank,
)

SCENARIOS = ("torchrun", "soft", "hard", "hard-no-heartbeat")


def _torchrun(out: Path):
    log, ckpt = out / "job.out", out / "ckpt"
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
    killed_at, exited, _, _ = cluster.fail_mid_run(log, ckpt, KILL_AFTER, lambda: _kill_last_rank(ckpt))
    return job, log, killed_at, exited


def _node(out: Path, hard: bool, heartbeat: bool):
    log, ckpt = out / "job.out", out / "ckpt"
    flags = MODEL + TRAINING + TP2 + ([] if heartbeat else ["--heartbeat-timeout-seconds", "0"])
    job = cluster.submit("train_tiny_cpu_slurm.sbatch", log, TWO_NODES, {**JOB_ENV, "CKPT": ckpt}, flags)
    kill = ["kill-node", "node2"] + (["--hard"] if hard else [])
    killed_at, exited, _, _ = cluster.fail_mid_run(log, ckpt, KILL_AFTER, lambda: cluster.nodes_tool(*kill))
    cluster.nodes_tool("start", "2")
    cluster.release(job)
    return job, log, killed_at, exited


def _job_restarted(log: Path, killed_at: float) -> float | None:
    """Seconds from the kill until the requeued job's batch script started (its log line has
    whole seconds); None when the job was not requeued."""
    start = re.search(r"> job \d+ start (\S+), restart 1", log.read_text())
    return time.mktime(time.strptime(start[1], "%Y-%m-%dT%H:%M:%S")) - killed_at if start else None


def run(scenario: str, out: Path) -> tuple[float, float | None, float, int]:
    if scenario == "torchrun":
        job, log, killed_at, exited = _torchrun(out)
    else:
        job, log, killed_at, exited = _node(out, hard=scenario != "soft", heartbeat=scenario != "hard-no-heartbeat")
    try:
        cluster.wait_for(
            "the resumed run", lambda: cluster.logged(log, r"> loaded [\s\S]*iteration\s+\d+/"), timeout=600
        )
        resumed, lost = cluster.recovery(log, killed_at)
        cluster.wait_for("the job to complete", lambda: cluster.finished(job, log), timeout=600)
    finally:
        cluster.cancel(job)
        cluster.nodes_tool("start", "2")
    return exited, _job_restarted(log, killed_at), resumed, lost


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    args = parser.parse_args()
    problem = cluster.node_failure_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in args.scenarios:
            out = Path(tmp) / scenario
            out.mkdir()
            results[scenario] = run(scenario, out)
            exited, restarted, resumed, lost = results[scenario]
            requeued = f"{restarted:5.0f} s" if restarted is not None else "    - "
            print(
                f"{scenario:18s}  survivors exited {exited:5.1f} s  requeued job started {requeued}  "
                f"training resumed {resumed:5.1f} s  iterations lost {lost}",
                flush=True,
            )
    if "hard" in results and "hard-no-heartbeat" in results:
        print(
            f"hard failure, survivors' exit: heartbeat off / on = "
            f"{results['hard-no-heartbeat'][0] / results['hard'][0]:.1f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
