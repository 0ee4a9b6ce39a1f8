"""Our checkpoint format (`--ckpt-format canonical`): the training state in its canonical form.

    <save>/iter_0000100/    DCP files (`__<rank>_0.distcp`, `.metadata`) and metadata.json
                            (format, iteration, model shape, data position, files' sizes and digests)

The pieces (state.py) are layout-independent, so any parallel layout loads them. All ranks
write into the staging directory (directory.py); once every rank has finished, rank 0 records
the files' digests, renames the directory and only then updates the tracker. A load first
checks the metadata against the model flags, then every file's size and digest (ranks share
the work), and refuses with one line naming the path. Same layout, same flags: the resumed run
repeats the uninterrupted one bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os

from megatron.core.checkpointing import CheckpointError, TensorPiece, write_pieces_with_digests
from megatron.core.transformer.model_fields import CONTEXT, differences, model_record
from megatron.training.checkpoint.directory import (
    METADATA,
    TRACKER,
    CheckpointInfo,
    barrier,
    global_rank,
    iteration_dir,
    prepare_staging,
    read_json,
    read_text,
    replace_checkpoint,
    write_text,
)

FORMAT = "torch_dist"
FORMAT_VERSION = 1


def publish_checkpoint(root: str, iteration: int, digests: dict, metadata: dict) -> str:
    """Once every rank's files are in the staging directory: rank 0 writes metadata.json (with format,
    iteration and the files' digests), renames the directory and only then points the tracker at it
    (a collective). Returns the checkpoint's directory."""
    final = iteration_dir(root, iteration)
    if global_rank() == 0:
        staging = final + ".tmp"
        record = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            **metadata,
            "files": digests,
        }
        write_text(os.path.join(staging, METADATA), json.dumps(record, indent=1))
        replace_checkpoint(staging, final, root, iteration)
    barrier()
    return final


def commit_checkpoint(root: str, iteration: int, pieces: list[TensorPiece], metadata: dict) -> str:
    """Write `pieces` as the checkpoint `<root>/iter_NNNNNNN` with `metadata` (plus format, iteration
    and file digests) and point the tracker at it. A collective when torch.distributed is initialised
    (every rank writes its own pieces); also runs in one process (a converter)."""
    staging = prepare_staging(root, iteration)
    digests = write_pieces_with_digests(pieces, staging)  # every file's on rank 0, which publishes
    return publish_checkpoint(root, iteration, digests, metadata)


# ---- finding and checking a checkpoint to load ---------------------------------------------------------


# Files that make a directory look like a saved model in some format (never ignored by --load)
_CHECKPOINT_LOOKS = (
    ("metadata.json", "a single checkpoint directory (metadata.json)"),
    (".metadata", "torch.distributed.checkpoint files (.metadata)"),
    ("common.pt", "a Megatron-LM torch_dist checkpoint directory (common.pt)"),
    ("model_optim_rng.pt", "a Megatron-LM legacy torch checkpoint (model_optim_rng.pt)"),
    ("config.json", "a Hugging Face model (config.json); convert it with tools/checkpoint/convert.py --loader hf"),
)
_CHECKPOINT_SUFFIXES = (".distcp", ".safetensors", ".pt", ".pth", ".bin")


def _what_checkpoint_is_here(root: str) -> str | None:
    """A description of checkpoint-like files in `root` that has no tracker (None: nothing like one)."""
    names = os.listdir(root)
    for name, description in _CHECKPOINT_LOOKS:
        if name in names:
            return description
    iterations = sorted(n for n in names if n.startswith("iter_") and not n.endswith(".tmp"))
    if iterations:
        return f"iter_* directories ({iterations[-1]}) but no {TRACKER} (an interrupted first save?)"
    for name in sorted(names):
        if name.endswith(_CHECKPOINT_SUFFIXES) or name.startswith("mp_rank_"):
            return f"{name}, which looks like saved model weights"
    return None


def find_checkpoint(root: str) -> CheckpointInfo | None:
    """The checkpoint `<root>`'s tracker names, with its metadata; None for a directory that does
    not exist yet or holds no checkpoint at all (training starts fresh, as Megatron does). Raises
    CheckpointError (one line) for anything else: a file, files that look like a checkpoint but no
    tracker, an unreadable tracker, a missing, partial or foreign checkpoint."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"--load {root}: is a file; pass the directory given to --save")
    if not os.path.isdir(root):
        return None
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        found = _what_checkpoint_is_here(root)
        if found is not None:
            raise CheckpointError(
                f"--load {root}: holds {found}, and no {TRACKER}; pass the directory given to "
                "--save (the parent of iter_*), or move these files away to start fresh"
            )
        return None
    text = read_text(tracker)
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text[:40]!r}")
    directory = iteration_dir(root, int(text))
    path = os.path.join(directory, METADATA)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (the checkpoint {TRACKER} names is absent or partial)")
    try:
        metadata = read_json(path)
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None
    if "sharded_backend" in metadata:
        raise CheckpointError(
            f"{directory}: a Megatron-LM {metadata['sharded_backend']} checkpoint: pretrain's "
            "--load reads it, and tools/checkpoint/convert.py --loader torch_dist"
        )
    if metadata.get("format") != FORMAT or metadata.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format {metadata.get('format')} version {metadata.get('format_version')}, "
            f"this code reads {FORMAT} version {FORMAT_VERSION}"
        )
    return CheckpointInfo(directory, int(text), metadata)


def check_compatible(info: CheckpointInfo, model_config, config) -> CheckpointInfo:
    """Refuse (one line) a checkpoint whose model differs from the flags in a field that changes the
    stored tensors or their meaning (see megatron.core.transformer.model_fields; --finetune may change
    positional fields, with a note), or that lacks the optimizer state the flags ask to load. Returns
    `info` with note lines for what was allowed or could not be checked."""
    differing, unknown = differences(info.metadata["model"], model_record(model_config))
    notes = []
    for difference in differing:
        if not (config.finetune and difference.field.kind == CONTEXT):
            raise CheckpointError(f"{info.directory}: {difference.sentence()}")
        notes.append(
            f"> note: --finetune changes how positions are encoded ({difference.sentence()}); the "
            "saved tensors keep their meaning"
        )
    if unknown:
        notes.append(
            f"> note: {info.directory} predates the record of {', '.join(f.flag for f in unknown)}: "
            "not compared with the flags (the tensor set still is)"
        )
    if not (config.no_load_optim or config.finetune) and "optimizer" not in info.metadata["contents"]:
        raise CheckpointError(
            f"{info.directory}: holds no optimizer state; pass --no-load-optim (or --finetune) "
            "to start the optimizer fresh"
        )
    return dataclasses.replace(info, notes=info.notes + tuple(notes))
