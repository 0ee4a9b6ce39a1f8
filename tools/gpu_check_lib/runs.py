"""In-process training runs through our trainer, as pretrain_llama.py builds and steps it.

One process, one rank: the process group is the launcher-less one pretrain.main starts
(launch_environment + init_distributed: NCCL on CUDA, gloo on CPU); each run parses
pretrain_llama.py flags into a RunConfig, builds a `Trainer` and calls `train_step`
iteration after iteration (the loop of pretrain.train without its log line, whose figures
are measured here instead).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch

from megatron.training.arguments.parser import LLAMA_DEFAULTS, parse_run_config
from megatron.training.initialize import choose_backend, init_distributed, launch_environment
from megatron.training.trainer import Trainer
from tools.gpu_check_lib.report import NA


@dataclass
class Context:
    """What every section reads: the device, whether this is a dry run, the part's deadline (its
    budget, or what is left of `--part all`'s, the smaller) and the device's peak (TFLOP/s or None,
    what the figure is)."""

    device: torch.device
    dry_run: bool
    budget_s: float
    started: float = field(default_factory=time.perf_counter)
    peak: tuple = (None, NA)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def skip(self, need_s: float) -> str | None:
        """None when `need_s` seconds (a GPU run's expected time) fit the part's budget, else why not."""
        if self.dry_run or self.left() >= need_s:
            return None
        return f"skipped: {self.left():.0f} s of the part's {self.budget_s:.0f} s budget left, {need_s:.0f} s needed"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def start_process_group(device: torch.device) -> None:
    launch_environment()
    init_distributed(choose_backend(None, device), 10, device)


def run_config(argv: list[str]):
    return parse_run_config(argv, LLAMA_DEFAULTS, 1, "gpu_check")


def free_device_memory(ctx: Context) -> None:
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


@dataclass
class Measured:
    losses: list = field(default_factory=list)
    step_s: object = NA  # seconds per timed iteration (NA on a dry run)
    syncs: object = NA  # host syncs per timed iteration (set_sync_debug_mode), NA without CUDA
    sync_sites: list = field(default_factory=list)
    max_allocated: object = NA
    max_reserved: object = NA
    allocated_before: object = NA  # torch.cuda.memory_allocated before the build: what earlier runs left
    extra: dict = field(default_factory=dict)  # what `inspect` collected
    error: str | None = None


class SyncCounter:
    """Counts the synchronizing CUDA calls torch warns about under set_sync_debug_mode('warn')."""

    def __init__(self, enabled: bool):
        self.enabled, self.count, self.sites = enabled, 0, []

    def __enter__(self):
        if self.enabled:
            self._catcher = warnings.catch_warnings(record=True)
            self._caught = self._catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        torch.cuda.set_sync_debug_mode("default")
        self._catcher.__exit__(*exc)
        found = [w for w in self._caught if "synchroniz" in str(w.message).lower()]
        self.count = len(found)
        self.sites = sorted({f"{w.filename.split('/')[-1]}:{w.lineno}" for w in found})
        return False


def error_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else '-'}"


def train(
    ctx: Context, argv: list[str], iters: int, warmup: int, *, count_syncs=False, inspect=None, hooks=None, prepare=None
):
    """`warmup` + `iters` iterations of the run `argv`; losses of all of them, the timed iterations'
    mean step time, syncs per timed iteration, the allocator's peaks since the build. `prepare(trainer)`
    runs after the build, `hooks(trainer)` after the warm-up (e.g. resets counters), `inspect(trainer,
    measured)` after the last step.
    Out of memory (or another runtime error) ends the run and is recorded, not raised."""
    free_device_memory(ctx)
    measured, trainer = Measured(), None
    if ctx.cuda:
        measured.allocated_before = torch.cuda.memory_allocated()
    try:
        trainer = Trainer(run_config(argv), ctx.device)
        if prepare is not None:
            prepare(trainer)
        results = [trainer.train_step(i) for i in range(1, warmup + 1)]
        trainer.optimizer.wait_for_step()
        if hooks is not None:
            hooks(trainer)
        ctx.sync()
        start = time.perf_counter()
        with SyncCounter(count_syncs and ctx.cuda) as syncs:
            results += [trainer.train_step(i) for i in range(warmup + 1, warmup + iters + 1)]
            trainer.optimizer.wait_for_step()
        ctx.sync()
        elapsed = time.perf_counter() - start
        measured.losses = [r.loss for r in results]
        if not ctx.dry_run:
            measured.step_s = elapsed / iters
        if count_syncs and ctx.cuda:
            measured.syncs, measured.sync_sites = syncs.count / iters, syncs.sites
        if ctx.cuda:
            measured.max_allocated = torch.cuda.max_memory_allocated()
            measured.max_reserved = torch.cuda.max_memory_reserved()
        if inspect is not None:
            inspect(trainer, measured)
    except (RuntimeError, ValueError, OSError) as error:  # torch.cuda.OutOfMemoryError is a RuntimeError
        measured.error = "out of memory" if isinstance(error, torch.cuda.OutOfMemoryError) else error_line(error)
        traceback.print_exc(file=sys.stderr)  # the report keeps one line; the log keeps where it came from
        if ctx.cuda:
            measured.max_allocated = torch.cuda.max_memory_allocated()
            measured.max_reserved = torch.cuda.max_memory_reserved()
    finally:
        if trainer is not None:
            with contextlib.suppress(RuntimeError):  # the step that ran out of memory
                trainer.optimizer.wait_for_step()
            trainer.close()
        del trainer
        free_device_memory(ctx)
    return measured
