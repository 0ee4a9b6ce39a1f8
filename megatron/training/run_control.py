"""When the training loop saves and when it stops early.

Saves: every --save-interval iterations and after the last iteration (with --save).
Early exits, each after saving (with --save): --exit-interval, --exit-duration-in-mins
and SIGTERM with --exit-signal-handler (the iteration in progress finishes first).
A signal may reach only some ranks and clocks differ, so the decision to exit is
taken together: the largest of the ranks' flags (one small all-reduce per iteration,
only when a signal or duration exit is asked for).
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist


class RunControl:
    def __init__(self, config, save, device, start_time: float | None = None):
        """`config`: CheckpointConfig; `save(iteration)`: saves a checkpoint (a collective; with
        --async-save it returns once the write has started, see checkpoint/save.py);
        `device`: where the exit flags are all-reduced (the backend's device)."""
        self.config, self.save, self.device = config, save, device
        self.start_time = time.monotonic() if start_time is None else start_time
        self.signalled = False
        if config.exit_signal_handler:
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    def _shared_exit_reason(self) -> str | None:
        config = self.config
        if not (config.exit_signal_handler or config.exit_duration_in_mins):
            return None
        minutes = (time.monotonic() - self.start_time) / 60.0
        flags = torch.tensor(
            [
                float(self.signalled),
                float(bool(config.exit_duration_in_mins) and minutes >= config.exit_duration_in_mins),
            ],
            device=self.device,
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0]:
            return "SIGTERM received (--exit-signal-handler)"
        if flags[1]:
            return f"--exit-duration-in-mins {config.exit_duration_in_mins} reached"
        return None

    def stop_reason(self, iteration: int) -> str | None:
        """Why training stops after this iteration (None: go on). Same answer on every rank."""
        reason = self._shared_exit_reason()
        if reason is None and self.config.exit_interval and iteration % self.config.exit_interval == 0:
            reason = f"--exit-interval {self.config.exit_interval} reached"
        return reason

    def save_if_due(self, iteration: int, last: int, reason: str | None) -> None:
        """Save after the last iteration, every --save-interval, and before an early exit (`reason`)."""
        config = self.config
        interval = config.save_interval and iteration % config.save_interval == 0
        due = iteration == last or reason is not None or interval
        if config.save and due:
            self.save(iteration)
