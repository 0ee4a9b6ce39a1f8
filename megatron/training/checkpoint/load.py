"""The one load entry point, for every format --load reads: ours (canonical.py) and Megatron-LM's
torch_dist (torch_dist.py).

`checkpoint_to_load(run)` finds the checkpoint --load names and checks it against the flags before
any process group exists (and before the datasets are sized: the batch schedule continues from the
saved sample count); `load_checkpoint(info, trainer, config)` then reads it into the trainer (a
collective). Either format's model and optimizer state load into any layout; RNG states only into
the layout that saved them.
"""

from __future__ import annotations

import dataclasses
import os

from megatron.core.checkpointing import (
    CheckpointError,
    TensorPiece,
    every_rank,
    model_pieces,
    read_pieces,
    saved_tensors,
    verify_files,
)
from megatron.core.checkpointing.megatron_buckets import BUCKET_FORM
from megatron.core.checkpointing.vocabulary import fit_rows, rows_note, saved_vocab_rows
from megatron.core.fp8.delayed import resume_delayed_scaling
from megatron.core.fp8.linear import is_fp8_state
from megatron.training.checkpoint.canonical import check_compatible, find_checkpoint
from megatron.training.checkpoint.directory import MEGATRON, OURS, TRACKER, CheckpointInfo, detect_checkpoint_format
from megatron.training.checkpoint.state import (
    MODEL_AS_MASTER,
    SAVED_MASTER,
    consumed_samples,
    layout_of,
    named_parameters,
    optimizer_pieces,
    rng_states,
    set_rng_states,
)
from megatron.training.checkpoint.torch_dist import megatron_checkpoint_to_load, stored_as_megatron
from megatron.training.checkpoint.torch_dist_buckets import read_bucket_state
from megatron.training.checkpoint.torch_dist_rng import load_megatron_rng


def continue_data_position(info: CheckpointInfo, run) -> CheckpointInfo:
    """The data order is a function of the samples consumed. When the flags' batch sizes reach another
    count at the checkpoint's iteration (--global-batch-size or its ramp-up changed), the run continues
    from the saved count, as Megatron does: the batch schedule restarts there, and the learning-rate
    clock from its saved value (from 0 when the optimizer state is not loaded, as Megatron's scheduler)."""
    saved, expected = info.metadata["consumed_samples"], consumed_samples(run, info.iteration)
    if saved == expected:
        return info
    fresh = run.checkpoint.no_load_optim
    updates = 0 if fresh else info.metadata["optimizer"]["step"]
    clock = 0 if fresh else info.metadata.get("update_samples", saved)  # absent: written before batch changes
    run.training.batch_schedule.resume_at(info.iteration, saved, updates, clock)
    note = (
        f"> {info.directory}: {saved} samples consumed by iteration {info.iteration} (the flags' batch sizes "
        f"would give {expected}); continuing from sample {saved} at global batch size "
        f"{run.training.batch_schedule.at(saved)}"
    )
    return dataclasses.replace(info, notes=info.notes + (note,))


def check_vocabulary(info: CheckpointInfo, model_config) -> CheckpointInfo:
    """Refuse (one line) vocabulary tensors shorter than --vocab-size; note (one line) those of another
    padded size than this layout's (Megatron pads to a multiple of --make-vocab-size-divisible-by x tp)."""
    saved = saved_vocab_rows(saved_tensors(info.directory))
    if saved is not None and saved < model_config.vocab_size:
        raise CheckpointError(
            f"{info.directory}: vocabulary tensors have {saved} rows, --vocab-size "
            f"{model_config.vocab_size} needs at least that many"
        )
    note = rows_note(info.directory, saved, model_config.padded_vocab_size, model_config.vocab_size)
    return dataclasses.replace(info, notes=info.notes + (note,)) if note else info


def checkpoint_to_load(run) -> CheckpointInfo | None:
    """The checkpoint --load names, in either format, checked against the flags; None without --load
    or when it holds no checkpoint yet (a fresh start, noted in `run.notes`)."""
    load = run.checkpoint.load
    if load is None:
        return None
    if detect_checkpoint_format(load) == MEGATRON:
        info = megatron_checkpoint_to_load(load, run)
    else:
        info = find_checkpoint(load)
        if info is None:
            state = "does not exist yet" if not os.path.isdir(load) else f"holds no {TRACKER}"
            run.notes.append(f"> note: --load {load} {state}: no checkpoint found, training starts from scratch")
            return None
        info = check_compatible(info, run.model, run.checkpoint)
    info = check_vocabulary(info, run.model)
    return info if run.checkpoint.finetune else continue_data_position(info, run)


def _load_optimizer(info: CheckpointInfo, trainer, stored) -> None:
    """Moments, master weights (the saved fp32 copies, or the checkpoint's model tensors where the
    saving run kept fp32 weights) and the step count and loss scaler, into any layout."""
    saved = info.metadata["optimizer"]
    separate = not all(shard.aliased for shard in trainer.optimizer.shards)  # low precision or offloaded
    if saved["master_weights"]:
        master = SAVED_MASTER
    else:  # fp32 weights saved: they are the master weights (already loaded where the master is the parameter)
        master = MODEL_AS_MASTER if separate else None
    pieces = optimizer_pieces(trainer, tied_copies=True, master=master)
    if saved.get("form") == BUCKET_FORM:  # Megatron-LM's distributed optimizer, in its buckets
        read_bucket_state(info.directory, info.metadata["megatron_args"], trainer, pieces)
    else:
        read_pieces(stored(pieces), info.directory)
    trainer.optimizer.load_scalar_state(saved)


def _refuse_unused_model_tensors(info: CheckpointInfo, pieces: list[TensorPiece]) -> None:
    """A model tensor of the checkpoint that no rank's model reads (a flag that adds tensors left out,
    e.g. --qk-layernorm or --add-qkv-bias) would be silently dropped: refuse, the same on every rank."""
    wanted = {piece.name for piece in pieces}
    saved = sorted(
        name
        for name in saved_tensors(info.directory)
        if not name.startswith(("optimizer.", "chained_", "rng.")) and not is_fp8_state(name)  # FP8: `_fp8_state`
    )
    # unused: by no rank (every rank holds the same list of saved names: one small all-reduce)
    unused = [name for name, none in zip(saved, every_rank([name not in wanted for name in saved])) if none]
    if unused:
        raise CheckpointError(
            f"{info.directory}: {len(unused)} saved model tensors have no place in the flags' "
            f"model, e.g. {unused[0]} (a flag that adds tensors is missing)"
        )


def _fp8_state(info: CheckpointInfo, trainer, pieces: list[TensorPiece]) -> tuple[list[TensorPiece], list[str]]:
    """Delayed scaling's amax histories and scales: loaded when saved; a checkpoint
    without them (BF16, or another FP8 recipe) starts them fresh, and a BF16 run ignores saved ones; one
    note line either way."""
    saved = {name for name in saved_tensors(info.directory) if is_fp8_state(name)}
    wanted = [piece for piece in pieces if is_fp8_state(piece.name)]
    missing = {piece.name for piece in wanted} - saved
    if missing and len(missing) < len(wanted):
        raise CheckpointError(f"{info.directory}: FP8 scaling state only partly saved, e.g. {sorted(missing)[0]}")
    if wanted and not missing:
        return pieces, []
    notes = []
    if wanted:
        notes.append("> the checkpoint holds no FP8 delayed-scaling state: amax histories start empty")
    elif saved:
        notes.append("> FP8 delayed-scaling state in the checkpoint not used (this run does not use delayed scaling)")
    return [piece for piece in pieces if not is_fp8_state(piece.name)], notes


def _why_rng_not_loaded(info: CheckpointInfo, trainer, config) -> str | None:
    """The log line saying why the RNG states are not loaded (None: they are)."""
    if config.no_load_rng:
        return "> --no-load-rng: RNG states not loaded"
    if "rng" not in info.metadata["contents"]:
        return "> the checkpoint holds no RNG states: RNG states not loaded"
    if info.metadata["layout"] != layout_of(trainer):
        return f"> RNG states not loaded: saved with layout {info.metadata['layout']}, running {layout_of(trainer)}"
    return None


def load_checkpoint(info: CheckpointInfo, trainer, config) -> tuple[int, list[str]]:
    """Load `info`'s checkpoint into the trainer (a collective). Returns (the iteration to continue
    from, lines for the log). Our files are verified against their digests, and every saved model
    tensor is matched to a parameter, before anything is read (Megatron-LM's files were checked against
    their `.metadata` when found)."""
    if info.format == OURS:
        verify_files(info.directory, info.metadata["files"])
        names = list
    else:  # our pieces -> the same data as pieces of Megatron-LM's tensors
        names = stored_as_megatron(trainer.run.model, info.directory)
    rows = saved_vocab_rows(saved_tensors(info.directory))  # another layout's padding: the rows both have

    def stored(pieces: list[TensorPiece]) -> list[TensorPiece]:
        return names(fit_rows(pieces, rows))

    trainer.optimizer.finish_param_sync()  # sharded parameters (optim_grads_params): whole, to be written
    pieces = stored(model_pieces(named_parameters(trainer), tied_copies=True))
    pieces, fp8_note = _fp8_state(info, trainer, pieces)
    _refuse_unused_model_tensors(info, pieces)
    why_not_rng = None if config.finetune else _why_rng_not_loaded(info, trainer, config)
    # our RNG states are read with the model (one DCP read less) and set once everything is loaded
    rng = rng_states(trainer) if info.format == OURS and not config.finetune and why_not_rng is None else {}
    read_pieces(pieces + [TensorPiece.whole(name, state) for name, state in rng.items()], info.directory)
    if any(is_fp8_state(piece.name) for piece in pieces):  # loaded: this layout's scales from the histories
        resume_delayed_scaling([chunk.module for chunk in trainer.chunks], trainer.mesh)
    for chunk in trainer.chunks:
        chunk.params_written()
    notes = [f"> loaded {info.directory} (iteration {info.iteration})", *info.notes, *fp8_note]
    # the optimizer state is read after params_written: where the fp32 master weights are the
    # parameters' shards, taking the shards from the whole parameters would overwrite saved masters
    if config.finetune or config.no_load_optim:
        trainer.optimizer.reload_master_weights()
        notes.append("> optimizer state not loaded: master weights from the model, moments zero, step 0")
    else:
        _load_optimizer(info, trainer, stored)
    if config.finetune:
        return 0, notes + ["> --finetune: model only; starting at iteration 0"]
    if why_not_rng is not None:
        notes.append(why_not_rng)
    elif info.format == MEGATRON:
        notes += [note] if (note := load_megatron_rng(trainer, info.directory)) else []
    else:
        set_rng_states(trainer, rng)
    return info.iteration, notes
