"""The iteration log line in Megatron-LM's format, its memory line, TensorBoard and W&B scalars."""

from __future__ import annotations

import datetime
import importlib
import math
import os
import resource
import sys

import torch


def _read(value) -> float:
    return value() if callable(value) else value


class IntervalTotals:
    """What the log line averages or counts since the last line, as Megatron counts: the loss
    averages the iterations that updated; a skipped iteration counts as nan when its loss is.
    Losses may be device tensors and times lazy (a callable returning the seconds, e.g. a
    pair of CUDA events): they are summed on the device or kept, and read only when a line
    asks for them."""

    def __init__(self):
        self.iterations = self.skipped = self.loss_count = 0
        self._loss_sum = self._nan = 0.0
        self._elapsed, self._idle = [], []
        self._extra = {}  # further losses by name (MoE's load_balancing_loss, z_loss), summed every iteration

    def add(self, loss, elapsed, skipped: bool, idle, extra: dict | None = None) -> None:
        """`loss`: a float or 0-dim tensor; `elapsed`, `idle`: floats or callables returning one; `extra`:
        further losses (averaged over every iteration of the window, as Megatron averages its MoE losses)."""
        loss = torch.as_tensor(loss, dtype=torch.float64)
        for name, value in (extra or {}).items():
            self._extra[name] = self._extra.get(name, 0.0) + torch.as_tensor(value, dtype=torch.float64)
        self.iterations += 1
        self._elapsed.append(elapsed)
        self._idle.append(idle)
        if skipped:
            self.skipped += 1
            self._nan = self._nan + (~torch.isfinite(loss)).double()
        else:
            self._loss_sum = self._loss_sum + loss
            self.loss_count += 1

    def state(self) -> dict:
        """The open window as plain numbers (read now), for a checkpoint."""
        return {
            "iterations": self.iterations,
            "skipped": self.skipped,
            "loss_count": self.loss_count,
            "loss_sum": float(self._loss_sum),
            "nan": float(self._nan),
            "elapsed": self.elapsed,
            "idle": self.idle_sum,
            "extra": {name: float(value) for name, value in self._extra.items()},
        }

    @classmethod
    def from_state(cls, state: dict) -> IntervalTotals:
        totals = cls()
        totals.iterations, totals.skipped, totals.loss_count = (
            state["iterations"],
            state["skipped"],
            state["loss_count"],
        )
        totals._loss_sum, totals._nan = state["loss_sum"], state["nan"]
        totals._elapsed, totals._idle = [state["elapsed"]], [state["idle"]]
        totals._extra = dict(state.get("extra", {}))
        return totals

    @property
    def loss(self) -> float:
        return float(self._loss_sum) / self.loss_count if self.loss_count else math.nan

    @property
    def extra(self) -> dict[str, float]:
        return {name: float(value) / self.iterations for name, value in self._extra.items()}

    @property
    def nan(self) -> int:
        return int(self._nan)

    @property
    def elapsed(self) -> float:
        return sum(_read(e) for e in self._elapsed)

    @property
    def idle_sum(self) -> float:
        return sum(_read(i) for i in self._idle)


def format_iteration_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    tflops_per_gpu: float,
    lr: float,
    global_batch_size: int,
    lm_loss: float,
    loss_scale: float,
    grad_norm,
    skipped: int,
    nan: int,
    num_zeros: int | None = None,
    params_norm: float | None = None,
    extra_losses: dict | None = None,
) -> str:
    """Megatron's line, timestamp included (leading space, microseconds)."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d} |",
        f" consumed samples: {consumed_samples:12d} |",
        f" elapsed time per iteration (ms): {elapsed_ms:.1f} |",
        f" throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu:.1f} |",
        f" learning rate: {lr:.6E} |",
        f" global batch size: {global_batch_size:5d} |",
        f" lm loss: {lm_loss:.6E} |",
        *(f" {name}: {value:.6E} |" for name, value in (extra_losses or {}).items()),
        f" loss scale: {loss_scale:.1f} |",
    ]
    for label, value, spec in (
        ("grad norm", grad_norm, ".3f"),
        ("num zeros", num_zeros, "d"),
        ("params norm", params_norm, ".3f"),
    ):
        if value is not None:
            parts.append(f" {label}: {value:{spec}} |")
    parts += [f" number of skipped iterations: {skipped:3d} |", f" number of nan iterations: {nan:3d} |"]
    return f" [{stamp}]" + "".join(parts)


def memory_figures(device: torch.device) -> dict[str, float]:
    """MB: on CUDA the allocator's four figures Megatron prints; elsewhere the process's resident memory."""
    mb = 1024.0 * 1024.0
    if device.type == "cuda":
        return {
            "allocated": torch.cuda.memory_allocated() / mb,
            "max allocated": torch.cuda.max_memory_allocated() / mb,
            "reserved": torch.cuda.memory_reserved() / mb,
            "max reserved": torch.cuda.max_memory_reserved() / mb,
        }
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"resident": resident / mb, "max resident": max(resident / mb, peak_kib / 1024.0)}


def memory_line(rank: int, iteration: int, figures: dict[str, float]) -> str:
    """`[Rank r] (after N iterations) memory (MB) | allocated: ... | max reserved: ...` (Megatron's)."""
    body = "".join(f" | {name}: {value:.2f}" for name, value in figures.items())
    return f"[Rank {rank}] (after {iteration} iterations) memory (MB){body}"


def _optional_module(module: str, given: str, package: str, consequence: str):
    """Import an optional logging backend, or warn once (one line) that the flag has no effect."""
    try:
        return importlib.import_module(module)
    except ImportError:
        print(
            f"warning: {given} given but {package} is not installed (pip install {package}); {consequence}",
            file=sys.stderr,
            flush=True,
        )
        return None


class TensorBoardWriter:
    """Writes scalars when tensorboard is installed; says so once when it is not."""

    def __init__(self, log_dir: str | None, enabled: bool):
        self.writer = None
        tensorboard = (
            _optional_module(
                "torch.utils.tensorboard", f"--tensorboard-dir {log_dir}", "tensorboard", "scalars are not written"
            )
            if log_dir and enabled
            else None
        )
        if tensorboard is not None:
            self.writer = tensorboard.SummaryWriter(log_dir=log_dir)

    def scalars(self, iteration: int, values: dict) -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            if value is not None:
                self.writer.add_scalar(key, value, iteration)
        self.writer.flush()


class WandbWriter:
    """Sends scalars to Weights & Biases when the wandb package is installed (WANDB_MODE=offline
    works without network); says so once when it is not."""

    def __init__(self, project: str | None, name: str | None, save_dir: str | None, config: dict, enabled: bool):
        self.run = None
        wandb = (
            _optional_module("wandb", f"--wandb-project {project}", "wandb", "scalars are not sent")
            if project and enabled
            else None
        )
        if wandb is not None:
            os.makedirs(save_dir, exist_ok=True)
            self.run = wandb.init(project=project, name=name, dir=save_dir, config=config)

    def scalars(self, iteration: int, values: dict) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in values.items() if v is not None}, step=iteration)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
