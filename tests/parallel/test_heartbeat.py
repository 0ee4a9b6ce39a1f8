"""--heartbeat-timeout-seconds: a rank whose peer went silent exits with a line naming it.

Two ranks started by hand (no launcher that would end them for us); once training runs, rank 1 is
frozen with SIGSTOP, so rank 0 blocks in a collective that would wait for the process group's
timeout (10 minutes). Its heartbeat watcher must end it, non-zero, within the documented bound.
(The multi-node case, a node losing power under SLURM, is tests/slurm/test_multinode.py.)

And the other side: a rank that fails while a collective of its is pending on a silent peer ends at
once, with its traceback, instead of waiting in the process group's teardown (gloo's destroy, and
the interpreter's exit, wait for that collective: the process group's timeout).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from megatron.training.arguments.parser import LLAMA_DEFAULTS, parse_run_config
from megatron.training.initialize import free_port
from tests.cli import ROOT, TINY_LLAMA

TIMEOUT = 3.0


def _start(rank: int, port: int, log, code: str | None = None) -> subprocess.Popen:
    """A rank of pretrain_llama.py, or of `code` run with the same flags in sys.argv."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH")}
    env.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    flags = TINY_LLAMA + ["--train-iters", "100000", "--heartbeat-timeout-seconds", str(TIMEOUT)]  # until frozen
    program = ["pretrain_llama.py"] if code is None else ["-c", code]
    return subprocess.Popen([sys.executable, *program, *flags], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _stop(ranks: list[subprocess.Popen], logs: list) -> None:
    for rank, log in zip(ranks, logs):
        rank.kill()
        rank.wait()
        log.close()


def test_a_frozen_peer_ends_the_waiting_rank_within_the_bound(tmp_path):
    port = free_port()
    logs = [open(tmp_path / f"rank{r}.log", "w+") for r in range(2)]  # noqa: SIM115 - closed in the finally block
    ranks = [_start(r, port, logs[r]) for r in range(2)]
    try:
        deadline = time.monotonic() + 120
        while "iteration        3/" not in (tmp_path / "rank1.log").read_text():
            assert time.monotonic() < deadline and ranks[1].poll() is None, (tmp_path / "rank1.log").read_text()
            time.sleep(0.1)
        ranks[1].send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        code = ranks[0].wait(timeout=60)
        waited = time.monotonic() - frozen
    finally:
        _stop(ranks, logs)
    text = (tmp_path / "rank0.log").read_text()
    assert code == 1, text[-2000:]
    assert re.search(
        rf"error: heartbeat: rank 0 \(\S+\) exits: rank 1 \(\S+ pid {ranks[1].pid}\) sent no heartbeat "
        rf"for [\d.]+ s \(--heartbeat-timeout-seconds 3\)",
        text,
    ), text[-2000:]
    assert "Traceback" not in text
    # the bound of heartbeat.py (timeout + 3 periods), plus the time the process takes to end
    assert TIMEOUT <= waited <= 1.6 * TIMEOUT + 2.0, waited


# pretrain's main with a training that fails on rank 0 while its all-reduce waits for rank 1, which has
# gone silent (SIGSTOP: no reset reaches rank 0, as when a node loses power)
FAILS_WITH_A_PENDING_COLLECTIVE = """
import os, signal, sys
import torch, torch.distributed as dist
from megatron.training import pretrain
from megatron.training.arguments.parser import LLAMA_DEFAULTS

def fail(validated, rank, world_size, backend):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(1), async_op=True)
    raise RuntimeError("injected failure")

pretrain._train_from = fail
sys.exit(pretrain.main(LLAMA_DEFAULTS, argv=sys.argv[1:]))
"""


def test_a_rank_that_fails_with_a_collective_pending_on_a_silent_peer_exits_at_once(tmp_path):
    port = free_port()
    logs = [open(tmp_path / f"rank{r}.log", "w+") for r in range(2)]  # noqa: SIM115 - closed in the finally block
    ranks = [_start(r, port, logs[r], FAILS_WITH_A_PENDING_COLLECTIVE) for r in range(2)]
    try:
        code = ranks[0].wait(timeout=60)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        _stop(ranks, logs)
    text = (tmp_path / "rank0.log").read_text()
    assert code == 1, f"exit status {code} (None: still running after 60 s)\n{text[-2000:]}"
    assert "RuntimeError: injected failure" in text and "Traceback" in text, text[-2000:]


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_negative_heartbeat_timeout_is_refused_in_one_line(value):
    with pytest.raises(ValueError, match=r"^--heartbeat-timeout-seconds must be >= 0 \(0 disables\), got"):
        parse_run_config(TINY_LLAMA + ["--heartbeat-timeout-seconds", value], LLAMA_DEFAULTS, 1)
