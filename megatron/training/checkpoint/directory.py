"""Megatron's checkpoint directory layout, shared by every format, and which format a directory holds.

    <root>/iter_0000100/                        one checkpoint (its format's files and metadata.json)
    <root>/latest_checkpointed_iteration.txt    the iteration to resume from, written last

A save writes into `iter_NNNNNNN.tmp`, which rank 0 renames once every rank has finished and
only then points the tracker at, so a crash during a save leaves the previous checkpoint (and
the tracker naming it) intact.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch.distributed as dist

from megatron.core.checkpointing import RECORD

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = RECORD  # metadata.json: ours (format, model record, data position, files' digests) or Megatron-LM's
OURS, MEGATRON = "ours", "torch_dist"  # our canonical format, Megatron-LM's torch_dist


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint found on disk, in either format, checked and ready to load."""

    directory: str
    iteration: int
    metadata: dict
    notes: tuple[str, ...] = ()  # lines for the log once loaded
    format: str = OURS  # or MEGATRON (see torch_dist.py)


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_text(path: str) -> str:
    """A small file's text, stripped (the tracker)."""
    with open(path) as handle:
        return handle.read().strip()


def read_json(path: str) -> dict:
    with open(path) as handle:
        return json.load(handle)


def detect_checkpoint_format(root: str) -> str | None:
    """OURS, MEGATRON (Megatron-LM's torch_dist), or None: no tracker, or no readable metadata.json
    in the checkpoint it names (the caller reports what is wrong)."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    text = read_text(tracker)
    if not text.isdigit():
        return None
    try:
        record = read_json(os.path.join(iteration_dir(root, int(text)), METADATA))
    except (OSError, json.JSONDecodeError):
        return None
    if record.get("sharded_backend") == "torch_dist":
        return MEGATRON
    return OURS if "format" in record else None


def write_text(path: str, text: str) -> None:
    """Write through a temporary name and rename: readers see the old or the new file, never a part."""
    with open(path + ".tmp", "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".tmp", path)


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    """All ranks meet (nothing in one process)."""
    if dist.is_initialized():
        dist.barrier()


def prepare_staging(root: str, iteration: int) -> str:
    """The empty temporary directory a save of `iteration` writes into (a collective)."""
    staging = iteration_dir(root, iteration) + ".tmp"
    if global_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # left by a crash during an earlier save
    barrier()
    return staging


def replace_checkpoint(staging: str, final: str, root: str, iteration: int) -> None:
    """Rename the finished staging directory to `final` (replacing an earlier save of the same
    iteration), then point the tracker at it (rank 0 only)."""
    if os.path.isdir(final):
        shutil.rmtree(final)
    os.replace(staging, final)
    write_text(os.path.join(root, TRACKER), str(iteration))
