"""A real SLURM for tests/slurm and tools/bench/node_failure.py: jobs, their logs and node failures.

The multi-node cluster is ../shared/tools/local_slurm_nodes.sh (`start 2`; .ci/run starts it;
LOCAL_SLURM_NODES names the script elsewhere). Its nodes are namespaces of this machine, so the
ranks' processes are visible here and their exits can be timed from the kill.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NODES_TOOL = Path(os.environ.get("LOCAL_SLURM_NODES", ROOT.parent / "shared" / "tools" / "local_slurm_nodes.sh"))
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*lm loss: (\S+) \|.*grad norm: (\S+) \|")
FAILED_STATES = ("FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def cluster_problem(nodes: int = 1) -> str | None:
    """Why no job on `nodes` nodes can run here (None: enough SLURM nodes are up)."""
    if shutil.which("sbatch") is None:
        return (
            "sbatch is not on PATH (start a local cluster as root: bash ../shared/tools/local_slurm_nodes.sh start 2)"
        )
    up = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=30)
    alive = {line.split()[0] for line in up.stdout.splitlines() if re.search(r"idle|mix|alloc", line)}
    if up.returncode or len(alive) < nodes:
        return (
            f"fewer than {nodes} SLURM node(s) up (sinfo: {(up.stdout + up.stderr).strip()[:200] or 'no nodes'}; "
            "bash ../shared/tools/local_slurm_nodes.sh start 2)"
        )
    return None


def node_failure_problem() -> str | None:
    """Why nodes cannot be killed and revived here (None: they can)."""
    problem = cluster_problem(2)
    if problem is None and not NODES_TOOL.is_file():
        problem = f"{NODES_TOOL} not found (set LOCAL_SLURM_NODES to local_slurm_nodes.sh)"
    if problem is None and os.geteuid() != 0:
        problem = "killing a node needs root"
    return problem


def scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True, timeout=30).stdout


def job_fields(job: str) -> dict:
    fields = scontrol("show", "job", "-o", job).split()
    return dict(field.split("=", 1) for field in fields if "=" in field)


def wait_for(what: str, condition, timeout: float = 300.0, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def submit(script: str, log: Path, sbatch: list[str] = (), env: dict | None = None, flags: list[str] = ()) -> str:
    """sbatch `script` (under examples/) from the repository root; returns the job id."""
    exports = ",".join(["ALL"] + [f"{k}={v}" for k, v in (env or {}).items()])
    return (
        subprocess.run(
            [
                "sbatch",
                "--parsable",
                f"--output={log}",
                f"--export={exports}",
                *sbatch,
                str(ROOT / "examples" / script),
                *flags,
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            timeout=60,
        )
        .stdout.strip()
        .split(";")[0]
    )


def state(job: str) -> str:
    return job_fields(job)["JobState"]


def finished(job: str, log: Path) -> bool:
    now = state(job)
    if now in FAILED_STATES:
        raise AssertionError(f"job {job} {now}; log:\n{log_tail(log)}")
    return now == "COMPLETED"


def log_tail(log: Path, chars: int = 4000) -> str:
    return log.read_text()[-chars:] if log.exists() else "(no log)"


def logged(log: Path, pattern: str) -> bool:
    return log.exists() and re.search(pattern, log.read_text()) is not None


def metrics(log: Path) -> dict[int, tuple[str, str]]:
    return metrics_of(log.read_text())


def metrics_of(text: str) -> dict[int, tuple[str, str]]:
    """Iteration -> (lm loss, grad norm) as logged; a repeated iteration keeps its last line."""
    return {int(m[1]): (m[2], m[3]) for m in LINE.finditer(text)}


def expected_after_resume(reference: dict[int, tuple[str, str]], first: int) -> dict[int, float]:
    """The losses a run resumed at iteration `first` logs: the uninterrupted run's, line for line
    (a resumed run's first line does not average into the next: tests/unit/test_resumed_log_lines.py)."""
    return {k: float(loss) for k, (loss, _) in reference.items() if k >= first}


def rank_pids(marker: str) -> list[int]:
    """Training processes whose command line holds `marker` (the test's checkpoint directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        python, script = os.path.basename(argv[0]).startswith(b"python"), argv[1:3]  # [-u] pretrain_llama.py
        trainer = python and any(arg.endswith(b"pretrain_llama.py") for arg in script)  # not srun, not torchrun
        if trainer and marker.encode() in b" ".join(argv):
            pids.append(int(entry.name))
    return pids


def rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(item[5:]) for item in env if item.startswith(b"RANK=")), None)


def nodes_tool(*args: str, timeout: float = 120) -> str:
    done = subprocess.run(["bash", str(NODES_TOOL), *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise AssertionError(f"local_slurm_nodes.sh {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


def _completing() -> bool:
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=30).stdout
    return "completing" in nodes


def release(job: str) -> None:
    """Start a requeued job in 2 s instead of after SLURM's hold (Reason=BeginTime, ~2 min). Not
    at once: slurmd refuses a credential issued in the second its job's last one was revoked
    ("Job credential revoked": the job fails), and its nodes must have finished the last run."""
    wait_for(f"job {job} to be requeued", lambda: state(job) == "PENDING", timeout=120)
    wait_for(f"the nodes of job {job} to finish its last run", lambda: not _completing(), timeout=120)
    scontrol("update", f"JobId={job}", "StartTime=now+2")


def cancel(*jobs: str) -> None:
    subprocess.run(["scancel", *jobs], capture_output=True, timeout=30)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def threads_of(pid: int) -> str:
    """Each thread of a process: name, state and the kernel function it waits in (where a process
    that should have exited is stuck, for a failure message)."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            name = (task / "comm").read_text().strip()
            state = (task / "stat").read_text().split(")")[-1].split()[0]
            wchan = (task / "wchan").read_text().strip()
        except OSError:
            continue
        lines.append(f"  {pid}/{task.name} {name} {state} {wchan}")
    return "\n".join(lines)


def fail_mid_run(
    log: Path, ckpt: Path, after: int, kill, snapshot_after: float = 0.0
) -> tuple[float, float, list[int], str]:
    """Once iteration `after` is logged, call kill() (a rank or a node); returns the wall-clock time
    of the kill, the seconds until every rank still alive right after it had exited, their pids,
    and (when snapshot_after > 0) the threads of the ranks still alive that many seconds later."""
    wait_for(f"iteration {after}", lambda: logged(log, rf"iteration\s+{after}/"), poll=0.05)
    killed_at, killed = time.time(), time.monotonic()
    kill()
    survivors = [pid for pid in rank_pids(str(ckpt)) if alive(pid)]
    late = ""

    def exited() -> bool:
        nonlocal late
        if snapshot_after and not late and time.monotonic() - killed > snapshot_after:
            late = "\n".join(threads_of(pid) for pid in survivors if alive(pid)) or "(none alive)"
        return not any(map(alive, survivors))

    wait_for("the surviving ranks to exit", exited, timeout=600, poll=0.05)
    return killed_at, time.monotonic() - killed, survivors, late


def restored_iterations(text: str) -> list[int]:
    """The iterations the log's runs resumed from, in order."""
    return [int(k) for k in re.findall(r"> loaded \S+ \(iteration (\d+)\)", text)]


def recovery(log: Path, killed_at: float) -> tuple[float, int]:
    """(seconds from the kill until the resumed run logged its first iteration, iterations lost:
    those logged before the failure that the resumed run did again)."""
    text = log.read_text()
    before, after = text.split("> loaded ", 1)
    stamp = re.search(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration", after)[1]
    resumed = time.mktime(time.strptime(stamp.split(".")[0], "%Y-%m-%d %H:%M:%S")) + float("0." + stamp.split(".")[1])
    return resumed - killed_at, max(metrics_of(before)) - restored_iterations(text)[0]
