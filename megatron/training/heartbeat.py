"""Peer-failure detection: a heartbeat through the rendezvous store, watched by a thread.

Why: a rank blocked in a collective whose peer died, or whose peer's node lost power (no FIN/RST
ever arrives), waits for the process group's timeout (--distributed-timeout-minutes, 10 by
default); its main thread cannot raise while blocked. Each rank starts a daemon thread that, every
period (timeout / 5):
  - increments this rank's counter in the store (the launcher's TCPStore at MASTER_ADDR:MASTER_PORT,
    reached through a connection of its own whose operations time out after one period);
  - reads the counter of the next rank (a ring: whatever set of ranks dies, if one survives, some
    survivor's successor is dead, so every failure is seen by some rank);
  - checks one shared key where a rank that saw a failure writes it.
A successor whose counter has not moved for the timeout, or a store that has not answered for the
timeout, ends the process: the reason is written to the shared key (so every rank learns it
within one period), one `error: heartbeat:` line names the rank and host that went silent, output
is flushed and the process ends with os._exit(EXIT_CODE) (a blocked main thread never returns to
Python to raise). From a peer's death to every survivor's exit: at most timeout + 3 periods
(1.6 x timeout) plus the store's answer time. A rank whose training raised posts its failure
(report_failure) and ends without tearing the process group down (pretrain._end_failed_rank).
Cost: three store round trips per rank and period,
no collective and nothing on the training thread.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
import uuid

import torch.distributed as dist

EXIT_CODE = 1
PERIODS_PER_TIMEOUT = 5
FAILED_KEY = "failed"


def _namespace() -> str:
    """Keys of this launch only, agreed through the process group (one broadcast at start): torchrun
    keeps its store across worker restarts, and its restart counts may differ between nodes, so the
    keys of an earlier attempt (a `failed` entry above all) must not reach the restarted workers."""
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    return f"megatron_heartbeat/{token[0]}/"


def _connect(timeout: float) -> dist.Store:
    """A connection of our own to the launcher's store (the process group's may wait for minutes)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(
        host, port, is_master=False, timeout=datetime.timedelta(seconds=max(timeout, 30.0)), wait_for_workers=False
    )
    store.set_timeout(datetime.timedelta(seconds=timeout / PERIODS_PER_TIMEOUT))  # a silent store: one period
    return dist.PrefixStore(_namespace(), store)


class Heartbeat:
    """One rank's heartbeat and watcher (start() after the process group exists; stop() once every
    rank is past the final barrier, so a peer that finished is never taken for a dead one)."""

    def __init__(self, timeout: float, rank: int, world_size: int):
        self.timeout, self.rank, self.world_size = timeout, rank, world_size
        self.period = timeout / PERIODS_PER_TIMEOUT
        self.successor = (rank + 1) % world_size
        self.host = socket.gethostname()
        self._stopped = threading.Event()
        self._store = _connect(timeout)
        self._store.set(f"host/{rank}", f"{self.host} pid {os.getpid()}")
        self._thread = threading.Thread(target=self._watch, name="heartbeat", daemon=True)

    @classmethod
    def start(cls, timeout: float, rank: int, world_size: int) -> Heartbeat | None:
        """None when disabled (timeout 0) or alone (nobody to wait for)."""
        if timeout <= 0 or world_size == 1:
            return None
        heartbeat = cls(timeout, rank, world_size)
        heartbeat._thread.start()
        return heartbeat

    def stop(self) -> None:
        self._stopped.set()

    def report_failure(self, what: str) -> None:
        """Tell every rank at once that this one is failing (its exception would otherwise be seen
        only as silence, a timeout later); this rank's watcher stops. A rank that hosts the store
        (rank 0 unless the launcher's agent does) stays one period, for the peers to read it."""
        self.stop()
        try:
            self._store.set(FAILED_KEY, f"rank {self.rank} ({self.host}) {what}")
        except Exception:  # the store may be gone too; the peers then see silence
            return
        if self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            time.sleep(self.period)

    def _peer(self, rank: int) -> str:
        key = f"host/{rank}"
        try:
            return self._store.get(key).decode() if self._store.check([key]) else "host unknown"
        except Exception:
            return "host unknown"

    def _watch(self) -> None:
        now = time.monotonic()
        last_answer = last_move = now
        seen = None
        beat = f"beat/{self.rank}"
        while not self._stopped.wait(self.period):
            try:
                self._store.add(beat, 1)
                count = self._store.add(f"beat/{self.successor}", 0)
                failed = self._store.get(FAILED_KEY).decode() if self._store.check([FAILED_KEY]) else None
            except Exception as error:  # no answer within a period: silent unless it lasts
                if not self._stopped.is_set() and time.monotonic() - last_answer > self.timeout:
                    host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
                    self._end(
                        f"the rendezvous store at {host}:{port} has not answered for "
                        f"{time.monotonic() - last_answer:.1f} s ({type(error).__name__})",
                        report=False,
                    )
                continue
            now = time.monotonic()
            last_answer = now
            if failed is not None:
                self._end(f"a peer failed: {failed}", report=False)
            if count != seen:
                seen, last_move = count, now
            elif now - last_move > self.timeout:
                silence = (
                    f"sent no heartbeat for {now - last_move:.1f} s (--heartbeat-timeout-seconds {self.timeout:g})"
                )
                self._end(f"rank {self.successor} ({self._peer(self.successor)}) {silence}", report=True)

    def _end(self, reason: str, report: bool) -> None:
        if self._stopped.is_set():
            return
        if report:
            self.report_failure(f"saw: {reason}")
        print(f"error: heartbeat: rank {self.rank} ({self.host}) exits: {reason}", file=sys.stderr, flush=True)
        try:
            sys.stdout.flush()
        finally:
            os._exit(EXIT_CODE)
