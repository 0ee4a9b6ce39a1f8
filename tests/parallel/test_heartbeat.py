"""--heartbeat-timeout-seconds: a rank whose peer went silent exits with a line naming it.

Two ranks started by hand (no launcher that would end them for us); once training runs, rank 1 is
frozen with SIGSTOP, so rank 0 blocks in a collective that would wait for the process group's
timeout (10 minutes). Its heartbeat watcher must end it, non-zero, within the documented bound.
(The multi-node case, a node losing power under SLURM, is tests/slurm/test_multinode.py.)
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


def _start(rank: int, port: int, log) -> subprocess.Popen:
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
    return subprocess.Popen(
        [sys.executable, "pretrain_llama.py", *flags], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
    )


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
        for rank, log in zip(ranks, logs):
            rank.kill()
            rank.wait()
            log.close()
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


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_negative_heartbeat_timeout_is_refused_in_one_line(value):
    with pytest.raises(ValueError, match=r"^--heartbeat-timeout-seconds must be >= 0 \(0 disables\), got"):
        parse_run_config(TINY_LLAMA + ["--heartbeat-timeout-seconds", value], LLAMA_DEFAULTS, 1)
