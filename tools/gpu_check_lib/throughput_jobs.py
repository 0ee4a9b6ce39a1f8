"""One training run of the throughput part, in a process of its own (so no run inherits another's allocator
state, compiled graphs or fragmentation):

    python -m tools.gpu_check_lib.throughput_jobs '<job as JSON>'

prints its figures as the last line of stdout, `RESULT_MARK` then JSON. A job (`Job`) names its kind: `ours`
(our Trainer as pretrain_llama.py builds it, tools/gpu_check_lib/runs.py `train`), `bare` (the bare PyTorch
loop of bare_llama.py, eager or with each block under torch.compile, SDPA pinned to the backend the attention
section measured fastest) or `torchtitan` (torchtitan_rows.py). `run_job` starts the process and reads its
line back; a dry run calls `execute` in this process instead (the same code, without the seconds each fresh
interpreter costs on a CPU), and compiles with torch.compile's "eager" backend (the graph capture without
inductor's code generation).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

RESULT_MARK = "THROUGHPUT_JOB_RESULT "
ROOT = Path(__file__).resolve().parents[2]
# the parent's one-rank launch variables (its TCP store holds MASTER_PORT): each job starts a process group of its own
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# Llama-3-8B's layer shape and vocabulary (issue 43); the dry run's tiny stand-in
SHAPE = dict(hidden=4096, ffn=14336, heads=32, groups=8, seq=8192, vocab=128256)
DRY_SHAPE = dict(hidden=64, ffn=128, heads=4, groups=2, seq=32, vocab=256)


@dataclass
class Job:
    kind: str  # "ours", "bare" or "torchtitan"
    dry_run: bool
    layers: int
    micro_batch: int = 1
    microbatches: int = 8
    warmup: int = 1
    iters: int = 2
    extra_argv: list = field(default_factory=list)  # flags beside the shape's: pretrain_llama.py's or torchtitan's
    compile: bool = False  # bare, torchtitan: under torch.compile
    sdpa_backend: str | None = None  # bare: the SDPA backend pinned (kernels/attention_rule.py)
    torchtitan_path: str | None = None  # torchtitan: where its wheels were unpacked (None: already importable)

    @property
    def shape(self) -> dict:
        return DRY_SHAPE if self.dry_run else SHAPE

    def argv(self) -> list[str]:
        """pretrain_llama.py flags of this run: the shape, bf16, mock data, a constant learning rate."""
        s = self.shape
        argv = ["--num-layers", str(self.layers), "--hidden-size", str(s["hidden"]), "--ffn-hidden-size", str(s["ffn"])]
        argv += ["--num-attention-heads", str(s["heads"]), "--group-query-attention", "--num-query-groups"]
        argv += [str(s["groups"]), "--seq-length", str(s["seq"]), "--max-position-embeddings", str(s["seq"])]
        argv += ["--vocab-size", str(s["vocab"]), "--micro-batch-size", str(self.micro_batch)]
        argv += ["--global-batch-size", str(self.micro_batch * self.microbatches)]
        argv += ["--train-iters", str(self.warmup + self.iters), "--bf16", "--mock-data"]
        return argv + ["--lr", "1e-4", "--lr-decay-style", "constant", *self.extra_argv]


def _device(dry_run: bool):
    import torch

    return torch.device("cpu") if dry_run else torch.device("cuda", torch.cuda.current_device())


def _ours(job: Job) -> dict:
    from tools.gpu_check_lib.runs import Context, train

    ctx = Context(_device(job.dry_run), job.dry_run, budget_s=float("inf"))
    measured = train(ctx, job.argv(), job.iters, job.warmup)
    figures = ("losses", "step_s", "max_allocated", "max_reserved", "error")
    return {name: getattr(measured, name) for name in figures}


def _bare(job: Job) -> dict:
    import torch

    from kernels.attention_rule import pinned_backend
    from tools.gpu_check_lib.bare_llama import BareLoop
    from tools.gpu_check_lib.report import NA
    from tools.gpu_check_lib.runs import error_line, run_config

    device = _device(job.dry_run)
    out = dict(losses=[], step_s=NA, max_allocated=NA, error=None)
    try:
        loop = BareLoop(run_config(job.argv()), device)
        if job.compile:
            for layer in loop.model.layers:  # each block, as torchtitan compiles: one graph for all of them
                layer.compile(backend="eager" if job.dry_run else "inductor")
        with pinned_backend(job.sdpa_backend):
            losses = [loop.step() for _ in range(job.warmup)]
            _sync(device)
            start = time.perf_counter()
            losses += [loop.step() for _ in range(job.iters)]
            _sync(device)
        out["losses"] = [x.item() for x in losses]
        if not job.dry_run:
            out["step_s"] = (time.perf_counter() - start) / job.iters
    except (RuntimeError, ValueError) as error:  # torch.cuda.OutOfMemoryError is a RuntimeError
        out["error"] = "out of memory" if isinstance(error, torch.cuda.OutOfMemoryError) else error_line(error)
    if device.type == "cuda":
        out["max_allocated"] = torch.cuda.max_memory_allocated()
    return out


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def execute(job: Job) -> dict:
    """Run `job` in this process: {losses, step_s, max_allocated, error} (`NA` where a dry run measures nothing)."""
    if job.kind == "ours":
        return _ours(job)
    if job.kind == "bare":
        return _bare(job)
    if job.kind == "torchtitan":
        from tools.gpu_check_lib.torchtitan_rows import run_torchtitan

        return run_torchtitan(job)
    raise ValueError(f"unknown job kind {job.kind!r} (valid: ours, bare, torchtitan)")


def job_environment(job: Job) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    paths = [str(ROOT)] + ([job.torchtitan_path] if job.torchtitan_path else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_job(job: Job, timeout_s: float, isolate: bool = True) -> dict:
    """`job` in a fresh process (`isolate`; else in this one), its result; a crash, a timeout or a missing
    result line is the result's `error` (the child's stderr is passed on to ours, for the log)."""
    if not isolate:
        return execute(job)
    command = [sys.executable, "-m", "tools.gpu_check_lib.throughput_jobs", json.dumps(asdict(job))]
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=job_environment(job), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as expired:
        _pass_on(expired.stderr)
        return dict(losses=[], step_s=None, max_allocated=None, error=f"timed out after {timeout_s:.0f} s")
    _pass_on(done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if lines:
        return json.loads(lines[-1][len(RESULT_MARK) :])
    last = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
    return dict(losses=[], step_s=None, max_allocated=None, error=f"process exited {done.returncode}: {last}")


def _pass_on(stderr) -> None:
    if stderr:
        sys.stderr.write(stderr if isinstance(stderr, str) else stderr.decode(errors="replace"))


def main(argv: list[str]) -> int:
    job = Job(**json.loads(argv[0]))
    if job.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if job.kind != "torchtitan":  # torchtitan starts its own process group from the launch variables
        from tools.gpu_check_lib.runs import start_process_group

        start_process_group(_device(job.dry_run))
    result = execute(job)
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
