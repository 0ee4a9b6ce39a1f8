"""Save and load training checkpoints in Megatron's directory layout.

    <save>/iter_0000100/           one checkpoint: DCP files (`__<rank>_0.distcp`, `.metadata`)
                                   and metadata.json (format, iteration, model shape, files' sizes and digests)
    <save>/latest_checkpointed_iteration.txt    the iteration to resume from, written last

The model is stored in its canonical, layout-independent form
(`megatron.core.checkpointing`), so any parallel layout loads it. All ranks write
into `iter_NNNNNNN.tmp`; once every rank has finished, rank 0 records the files'
digests, renames the directory and only then updates the tracker file, so a crash
during a save leaves the previous checkpoint (and the tracker naming it) intact.
A load first checks the metadata against the model flags, then every file's size
and digest (ranks share the work), and refuses with one line naming the path.

Optimizer state is canonical too (per parameter: Adam moments and, for bf16/fp16
weights, fp32 master weights, at the parameter's global shape), so it reshards like
the model; the step count, loss scaler and consumed samples are in metadata.json.
RNG states (torch's generators per rank, each model chunk's dropout streams) are
bound to the parallel layout: they are loaded only into the layout that saved them.
Same layout, same flags: the resumed run repeats the uninterrupted one bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core.checkpointing import (
    MOMENTS,
    RECORD,
    CheckpointError,
    TensorPiece,
    digest_files,
    model_pieces,
    optimizer_state_pieces,
    read_pieces,
    saved_tensors,
    state_name,
    verify_files,
    write_pieces,
)
from megatron.core.transformer.model_fields import CONTEXT, differences, model_record

FORMAT = "torch_dist"
FORMAT_VERSION = 1
TRACKER = "latest_checkpointed_iteration.txt"
METADATA = RECORD  # metadata.json: format, model record, data position, the other files' digests


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def layout_of(trainer) -> dict:
    dims = trainer.mesh.dims
    return {
        "tp": dims.tp,
        "cp": dims.cp,
        "dp": dims.dp,
        "pp": dims.pp,
        "virtual_stages": trainer.run.parallel.virtual_stages,
    }


SAVED_MASTER = functools.partial(state_name, "master")  # bf16/fp16 weights: their fp32 copies
MODEL_AS_MASTER = str  # fp32 weights saved: the model tensor itself is the master


def optimizer_pieces(trainer, *, tied_copies: bool, master=None) -> list[TensorPiece]:
    """The optimizer's per-parameter state as canonical pieces (see
    megatron.core.checkpointing.optimizer_state), written beside the model and filled in place on
    load. `master`: the checkpoint name of a parameter's master weights (None: left out)."""
    sources = {key: functools.partial(state_name, key) for key in MOMENTS}
    if master is not None:
        sources["master"] = master
    return optimizer_state_pieces(
        trainer.optimizer.state_dict_by_name(), dict(_named_parameters(trainer)), sources, tied_copies=tied_copies
    )


def _low_precision(trainer) -> bool:
    """Whether the weights are bf16/fp16, so that their fp32 master weights are a separate state."""
    return trainer.run.model.params_dtype != torch.float32


# ---- RNG ---------------------------------------------------------------------------------------------


def _rng_states(trainer) -> dict[str, torch.Tensor]:
    """Name -> state of torch's generators on this rank and of each model chunk's dropout streams
    (named by global stage, cp and tp rank: equal on dp replicas, which DCP writes once)."""
    mesh, rank = trainer.mesh, dist.get_rank()
    states = {f"rng.torch.rank_{rank:05d}": torch.get_rng_state()}
    if trainer.device.type == "cuda":
        states[f"rng.cuda.rank_{rank:05d}"] = torch.cuda.get_rng_state(trainer.device)
    for c, chunk in enumerate(trainer.chunks):
        stage = c * mesh.pp_size + mesh.pp_rank
        for tensor_parallel, state in chunk.module.decoder.rng_tracker.get_state().items():
            stream = "tensor_parallel" if tensor_parallel else "replicated"
            states[f"rng.dropout.stage_{stage}.cp_{mesh.cp_rank}.tp_{mesh.tp_rank}.{stream}"] = state
    return states


def _set_rng_states(trainer, states: dict[str, torch.Tensor]) -> None:
    rank = dist.get_rank()
    torch.set_rng_state(states[f"rng.torch.rank_{rank:05d}"])
    if trainer.device.type == "cuda":
        torch.cuda.set_rng_state(states[f"rng.cuda.rank_{rank:05d}"], trainer.device)
    mesh = trainer.mesh
    for c, chunk in enumerate(trainer.chunks):
        prefix = f"rng.dropout.stage_{c * mesh.pp_size + mesh.pp_rank}.cp_{mesh.cp_rank}.tp_{mesh.tp_rank}"
        chunk.module.decoder.rng_tracker.set_state(
            {False: states[f"{prefix}.replicated"], True: states[f"{prefix}.tensor_parallel"]}
        )


# ---- save --------------------------------------------------------------------------------------------


def _named_parameters(trainer):
    """Every model tensor a checkpoint holds: the parameters, and the buffers that carry an InitSpec (state
    that training changes outside the optimizer: the MoE router's expert bias)."""
    for chunk in trainer.chunks:
        yield from chunk.module.named_parameters()
        yield from ((name, b) for name, b in chunk.module.named_buffers() if hasattr(b, "init_spec"))


def write_text(path: str, text: str) -> None:
    """Write through a temporary name and rename: readers see the old or the new file, never a part."""
    with open(path + ".tmp", "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(path + ".tmp", path)


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def prepare_staging(root: str, iteration: int) -> str:
    """The empty temporary directory a save of `iteration` writes into (a collective)."""
    staging = iteration_dir(root, iteration) + ".tmp"
    if global_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # left by a crash during an earlier save
    _barrier()
    return staging


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
    _barrier()
    return final


def replace_checkpoint(staging: str, final: str, root: str, iteration: int) -> None:
    """Rename the finished staging directory to `final` (replacing an earlier save of the same
    iteration), then point the tracker at it (rank 0 only)."""
    if os.path.isdir(final):
        shutil.rmtree(final)
    os.replace(staging, final)
    write_text(os.path.join(root, TRACKER), str(iteration))


def commit_checkpoint(root: str, iteration: int, pieces: list[TensorPiece], metadata: dict) -> str:
    """Write `pieces` as the checkpoint `<root>/iter_NNNNNNN` with `metadata` (plus format, iteration
    and file digests) and point the tracker at it. A collective when torch.distributed is initialised
    (every rank writes its own pieces); also runs in one process (a converter)."""
    staging = prepare_staging(root, iteration)
    files = write_pieces(pieces, staging)
    return publish_checkpoint(root, iteration, digest_files(staging, files), metadata)


def checkpoint_contents(
    trainer, iteration: int, rng: bool = True, log_window: dict | None = None
) -> tuple[list[TensorPiece], dict]:
    """(this rank's pieces: model, optimizer state and, with `rng`, RNG states; the metadata) of a
    save after `iteration`, with the log's open averaging window when given. The pieces are views
    of the live tensors."""
    trainer.optimizer.finish_param_sync()  # --overlap-param-gather: the weights must be whole
    master = SAVED_MASTER if _low_precision(trainer) else None  # fp32 weights are their own master
    pieces = (
        model_pieces(_named_parameters(trainer), tied_copies=False)
        + optimizer_pieces(trainer, tied_copies=False, master=master)
        + ([TensorPiece.whole(name, state) for name, state in _rng_states(trainer).items()] if rng else [])
    )
    metadata = {
        "consumed_samples": consumed_samples(trainer.run, iteration),
        "update_samples": trainer.run.training.batch_schedule.update_samples(trainer.optimizer.adam.step_count),
        "model": model_record(trainer.run.model),
        "layout": layout_of(trainer),
        "optimizer": {**trainer.optimizer.scalar_state(), "master_weights": master is not None},
        "contents": ["model", "optimizer"] + (["rng"] if rng else []),
    }
    if log_window is not None:
        metadata["log_window"] = log_window
    return pieces, metadata


def save_checkpoint(root: str, iteration: int, trainer, log_window: dict | None = None) -> str:
    """Save model, optimizer state, RNG states and the data position after `iteration` (and the
    log's open window) as `<root>/iter_NNNNNNN` (a collective: every rank writes its own pieces).
    Returns the directory."""
    return commit_checkpoint(root, iteration, *checkpoint_contents(trainer, iteration, log_window=log_window))


def consumed_samples(run, iteration: int) -> int:
    """Samples consumed by iterations 1..iteration (with a growing batch size, not iteration x G)."""
    return run.training.batch_schedule.consumed_before(iteration + 1)


# ---- load --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointInfo:
    directory: str
    iteration: int
    metadata: dict
    notes: tuple[str, ...] = ()  # lines for the log once loaded
    format: str = "ours"  # or "torch_dist": Megatron-LM's (see checkpoint_formats.py)


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
    text = open(tracker).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text[:40]!r}")
    directory = iteration_dir(root, int(text))
    path = os.path.join(directory, METADATA)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (the checkpoint {TRACKER} names is absent or partial)")
    try:
        metadata = json.load(open(path))
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


def checkpoint_to_load(run) -> CheckpointInfo | None:
    """The checkpoint --load names, checked against the flags before any process group exists (and
    before the datasets are sized: the run's batch schedule continues from the saved sample count);
    None without --load or when it holds no checkpoint yet (a fresh start, noted in `run.notes`)."""
    load = run.checkpoint.load
    if load is None:
        return None
    info = find_checkpoint(load)
    if info is None:
        state = "does not exist yet" if not os.path.isdir(load) else f"holds no {TRACKER}"
        run.notes.append(f"> note: --load {load} {state}: no checkpoint found, training starts from scratch")
        return None
    info = check_compatible(info, run.model, run.checkpoint)
    if not run.checkpoint.finetune:
        info = continue_data_position(info, run)
    return info


def _as_stored(pieces: list[TensorPiece]) -> list[TensorPiece]:
    return pieces


def _load_optimizer(info: CheckpointInfo, trainer, stored) -> None:
    """Moments, master weights (the saved fp32 copies, or the checkpoint's model tensors where the
    saving run kept fp32 weights) and the step count and loss scaler, into any layout."""
    saved = info.metadata["optimizer"]
    separate = not all(shard.aliased for shard in trainer.optimizer.shards)  # low precision or offloaded
    if saved["master_weights"]:
        master = SAVED_MASTER
    else:  # fp32 weights saved: they are the master weights (already loaded where the master is the parameter)
        master = MODEL_AS_MASTER if separate else None
    read_pieces(stored(optimizer_pieces(trainer, tied_copies=True, master=master)), info.directory)
    trainer.optimizer.load_scalar_state(saved)


def _refuse_unused_model_tensors(info: CheckpointInfo, pieces: list[TensorPiece]) -> None:
    """A model tensor of the checkpoint that no rank's model reads (a flag that adds tensors left out,
    e.g. --qk-layernorm or --add-qkv-bias) would be silently dropped: refuse, the same on every rank."""
    wanted = {piece.name for piece in pieces}
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, wanted)
        wanted = set().union(*gathered)
    unused = sorted(
        name
        for name in saved_tensors(info.directory)
        if not name.startswith(("optimizer.", "rng.")) and name not in wanted
    )
    if unused:
        raise CheckpointError(
            f"{info.directory}: {len(unused)} saved model tensors have no place in the flags' "
            f"model, e.g. {unused[0]} (a flag that adds tensors is missing)"
        )


def load_checkpoint(info: CheckpointInfo, trainer, config, stored=_as_stored) -> tuple[int, list[str]]:
    """Load `info`'s checkpoint into the trainer (a collective). Returns (the iteration to continue
    from, lines for the log). Our files are verified against their digests, and every saved model
    tensor is matched to a parameter, before anything is read. `stored`: our pieces -> the pieces as
    the checkpoint stores them (another format's names)."""
    if info.format == "ours":
        verify_files(info.directory, info.metadata["files"])
    trainer.optimizer.finish_param_sync()  # sharded parameters (optim_grads_params): whole, to be written
    pieces = stored(model_pieces(_named_parameters(trainer), tied_copies=True))
    _refuse_unused_model_tensors(info, pieces)
    read_pieces(pieces, info.directory)
    for chunk in trainer.chunks:
        chunk.params_written()
    notes = [f"> loaded {info.directory} (iteration {info.iteration})", *info.notes]
    if config.finetune or config.no_load_optim:
        trainer.optimizer.reload_master_weights()
        notes.append("> optimizer state not loaded: master weights from the model, moments zero, step 0")
    else:
        _load_optimizer(info, trainer, stored)
    if config.finetune:
        return 0, notes + ["> --finetune: model only; starting at iteration 0"]
    if config.no_load_rng:
        notes.append("> --no-load-rng: RNG states not loaded")
    elif "rng" not in info.metadata["contents"]:
        notes.append("> the checkpoint holds no RNG states: RNG states not loaded")
    elif info.metadata["layout"] != layout_of(trainer):
        notes.append(
            f"> RNG states not loaded: saved with layout {info.metadata['layout']}, running {layout_of(trainer)}"
        )
    else:
        states = _rng_states(trainer)
        read_pieces([TensorPiece.whole(name, state) for name, state in states.items()], info.directory)
        _set_rng_states(trainer, states)
    return info.iteration, notes
