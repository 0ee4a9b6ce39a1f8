"""The one save entry point: `save_checkpoint` writes the run's --ckpt-format (ours, canonical.py, or
Megatron-LM's torch_dist, torch_dist.py); `CheckpointSaver` makes the training loop's saves with it, or
in the background with --async-save (ours only).

An asynchronous save blocks training only to copy this rank's pieces (model, optimizer state,
RNG states) to host memory. A writer thread then writes the copies into `iter_NNNNNNN.tmp`
through torch.distributed.checkpoint, on a gloo process group of its own (so its collectives
never interleave with training's), digesting its files as it writes them. The checkpoint
is finalized as a synchronous save is (digests shared, metadata.json written, the directory
renamed, the tracker rewritten last) only once every rank's writer has finished: while a
save is pending the ranks agree on that through one small all-reduce per iteration (`poll`).
The next save and the end of training (last iteration, --exit-interval,
--exit-duration-in-mins, SIGTERM) wait for a pending save and finalize it. A crash before
then leaves the previous checkpoint and the tracker untouched.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core.checkpointing import CheckpointError, write_pieces_with_digests
from megatron.training.checkpoint.canonical import commit_checkpoint, publish_checkpoint
from megatron.training.checkpoint.directory import MEGATRON, prepare_staging
from megatron.training.checkpoint.state import checkpoint_contents
from megatron.training.checkpoint.torch_dist import save_megatron_checkpoint


def save_checkpoint(root: str, iteration: int, trainer, log_window: dict | None = None) -> str:
    """Save model, optimizer state, RNG states and the data position after `iteration` (and the
    log's open window) as `<root>/iter_NNNNNNN` in the run's --ckpt-format (a collective: every rank
    writes its own pieces). Megatron-LM's format has no place for RNG states or the log window.
    Returns the directory."""
    if trainer.run.checkpoint.ckpt_format == MEGATRON:
        return save_megatron_checkpoint(root, iteration, trainer)
    return commit_checkpoint(root, iteration, *checkpoint_contents(trainer, iteration, log_window=log_window))


def _in_background(fn, *args) -> Future:
    """Run `fn(*args)` in a daemon thread: a rank that crashes does not wait for it to exit."""
    future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # noqa: BLE001 - handed to the finalizing thread
            future.set_exception(error)

    threading.Thread(target=run, name="checkpoint-writer", daemon=True).start()
    return future


@dataclass
class _Pending:
    iteration: int
    staging: str
    metadata: dict
    written: Future  # the digests of this rank's files


class CheckpointSaver:
    """Saves into `root`; every method is a collective (all ranks call them at the same points)."""

    def __init__(self, root: str, trainer, emit, asynchronous: bool, log_window=None):
        """`log_window()`: the log's open averaging window, stored with each save (a collective)."""
        self.root, self.trainer, self.emit = root, trainer, emit
        self.log_window = log_window
        self.group = dist.new_group(backend="gloo") if asynchronous else None
        self.pending: _Pending | None = None

    def save(self, iteration: int) -> None:
        window = self.log_window() if self.log_window is not None else None
        if self.group is None:
            self.emit(f"> saved {save_checkpoint(self.root, iteration, self.trainer, window)}")
            return
        self.finish()  # one save in flight at a time
        pieces, metadata = checkpoint_contents(self.trainer, iteration, log_window=window)
        staging = prepare_staging(self.root, iteration)
        snapshot = [piece.snapshot() for piece in pieces]
        self.pending = _Pending(
            iteration, staging, metadata, _in_background(write_pieces_with_digests, snapshot, staging, self.group)
        )
        self.emit(f"> saving {staging} in the background (iteration {iteration})")

    def poll(self) -> None:
        """Finalize the pending save if every rank's writer has finished (one all-reduce while a save
        is pending; nothing otherwise, the same on every rank)."""
        if self.pending is None:
            return
        busy = torch.tensor([float(not self.pending.written.done())], device=self.trainer.device)
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        if busy.item() == 0:
            self._finalize()

    def finish(self) -> None:
        """Wait for the pending save, if any, and finalize it."""
        if self.pending is not None:
            self._finalize()

    def _finalize(self) -> None:
        pending, self.pending = self.pending, None
        error = pending.written.exception()  # waits for this rank's writer
        outcome = (None, f"{type(error).__name__}: {error}") if error is not None else (pending.written.result(), None)
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, outcome)
        failed = [(rank, why) for rank, (_, why) in enumerate(outcomes) if why is not None]
        if failed:
            rank, why = failed[0]
            raise CheckpointError(
                f"{pending.staging}: the background write failed on rank {rank} ({why}); "
                "the previous checkpoint stays the latest"
            )
        digests = {name: digest for share, _ in outcomes for name, digest in share.items()}
        final = publish_checkpoint(self.root, pending.iteration, digests, pending.metadata)
        self.emit(f"> saved {final} (written in the background)")
