"""The iteration log line in Megatron-LM's format, the start-up summary, TensorBoard scalars."""
from __future__ import annotations

import datetime
import math
import sys
from dataclasses import dataclass


@dataclass
class IntervalTotals:
    """What the log line averages or counts over one --log-interval window."""

    loss_sum: float = 0.0
    loss_count: int = 0
    elapsed: float = 0.0
    iterations: int = 0
    skipped: int = 0
    nan: int = 0
    idle_sum: float = 0.0

    def add(self, loss: float, elapsed: float, skipped: bool, grad_norm, idle: float) -> None:
        self.iterations += 1
        self.elapsed += elapsed
        self.idle_sum += idle
        if skipped:
            self.skipped += 1
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            self.nan += 1
        else:
            self.loss_sum += loss
            self.loss_count += 1


def format_iteration_line(*, iteration: int, train_iters: int, consumed_samples: int, elapsed_ms: float,
                          tflops_per_gpu: float, lr: float, global_batch_size: int, lm_loss: float,
                          loss_scale: float, grad_norm, skipped: int, nan: int) -> str:
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d} |",
        f" consumed samples: {consumed_samples:12d} |",
        f" elapsed time per iteration (ms): {elapsed_ms:.1f} |",
        f" throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.1f} |",
        f" learning rate: {lr:.6E} |",
        f" global batch size: {global_batch_size:5d} |",
        f" lm loss: {lm_loss:.6E} |",
        f" loss scale: {loss_scale:.1f} |",
    ]
    if grad_norm is not None:
        parts.append(f" grad norm: {grad_norm:.3f} |")
    parts += [f" number of skipped iterations: {skipped:3d} |", f" number of nan iterations: {nan:3d} |"]
    return f"[{stamp}]" + "".join(parts)


class TensorBoardWriter:
    """Writes the log line's scalars when tensorboard is installed; says so once when it is not."""

    def __init__(self, log_dir: str | None, enabled: bool):
        self.writer = None
        if not (log_dir and enabled):
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print(f"warning: --tensorboard-dir {log_dir} given but tensorboard is not installed "
                  "(pip install tensorboard); scalars are not written", file=sys.stderr, flush=True)
            return
        self.writer = SummaryWriter(log_dir=log_dir)

    def scalars(self, iteration: int, values: dict) -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            if value is not None:
                self.writer.add_scalar(key, value, iteration)
        self.writer.flush()
