"""Running the entry points and tools as a user would, shared by the tests."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the shipped GPT-2 byte-level BPE tokenizer, as pretrain/preprocess flags
BPE = ROOT / "data" / "tokenizers" / "gpt2-bpe"
GPT2_BPE = [
    "--tokenizer-type",
    "GPT2BPETokenizer",
    "--vocab-file",
    str(BPE / "vocab.json"),
    "--merge-file",
    str(BPE / "merges.txt"),
]

# a tiny Llama with grouped-query attention on mock data: 5 iterations, every one logged
TINY_LLAMA = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "4",
    "--train-iters",
    "5",
    "--log-interval",
    "1",
    "--mock-data",
    "--vocab-size",
    "256",
]


def run_cli(script: str, flags: list[str], nproc: int = 1, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python <script> flags`, or through torchrun with `nproc` ranks, from the repository root."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH")}
    env["OMP_NUM_THREADS"] = "1"
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc)] if nproc > 1 else []
    return subprocess.run(
        [sys.executable] + launcher + [script] + flags,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


def explain(proc: subprocess.CompletedProcess) -> str:
    """A failed run's cause: the ranks' error lines (torchrun's own report buries them), then the tail."""
    causes = [
        line
        for line in proc.stderr.splitlines()
        if re.search(r"Error|error:|terminate called|Traceback|Signal \d+", line)
    ]
    return "\n".join(causes[:40]) + "\n--- stderr tail ---\n" + proc.stderr[-1500:]


def printed_losses(stdout: str) -> list[float]:
    """The lm loss of every iteration line."""
    return [float(x) for x in re.findall(r"lm loss: (\S+) \|", stdout)]


@functools.cache
def _one_rank(script: str, flags: tuple) -> subprocess.CompletedProcess:
    return run_cli(script, list(flags))


def torchrun_matching_one_rank(
    script: str, base: list[str], extra: list[str], nproc: int
) -> subprocess.CompletedProcess:
    """Run `script` with `base` on one rank (once per session) and with `base + extra` under
    torchrun with `nproc` ranks; both succeed and print the same 5 losses (2e-6 relative: data
    parallelism sums the microbatches' gradients in another order). Returns the torchrun run."""
    one = _one_rank(script, tuple(base))
    many = run_cli(script, base + extra, nproc=nproc)
    assert one.returncode == 0, explain(one)
    assert many.returncode == 0, explain(many)
    expected, losses = printed_losses(one.stdout), printed_losses(many.stdout)
    assert len(expected) == len(losses) == 5, f"{losses} vs {expected}"
    assert all(abs(a - b) <= 2e-6 * b for a, b in zip(losses, expected)), f"{losses} vs {expected}"
    return many


def load_tool(name: str):
    """Import tools/<name>.py; registered by name so its worker processes can unpickle its functions."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
