"""Megatron-LM's `torch_dist` checkpoints, read (`--load`) and written (`--ckpt-format torch_dist`).

A Megatron-LM checkpoint (`--load` of a directory that Megatron-LM or `--ckpt-format torch_dist`
wrote) is read with plain torch.distributed.checkpoint, in any of our layouts:
- model weights, mapped piece by piece (megatron.core.checkpointing.megatron_lm);
- the optimizer state in its model-space form (`optimizer.state.exp_avg.<name>`, ...: Megatron's
  non-distributed optimizer, or the fully reshardable form of its distributed one), the step
  count (`common_step`, or the param groups' `step` of fused Adam), the iteration, consumed
  samples (`args.consumed_train_samples`) and the scheduler's position (`num_steps`, in samples
  as ours);
- `common.pt` is unpickled with stand-ins for megatron classes (it is never imported). Its
  `args` are compared with our flags (torch_dist_args.py), and every `.distcp` file must be as
  long as `.metadata` says (Megatron-LM records no digests), before anything is read.
- the distributed optimizer's `dp_reshardable` bucket form (`optimizer.distributed.*`: Megatron-LM's
  default with --use-distributed-optimizer), mapped to our canonical state by torch_dist_buckets.py;
- RNG states in the layout that saved them (torch_dist_rng.py).

A save with `--ckpt-format torch_dist` writes what megatron-core's `dist_checkpointing.load`
reads for a GPTModel and its optimizer: the stacked tensors with the trained vocabulary padding
(`make_vocab_size_divisible_by` x our tp, as Megatron pads), Adam moments (and fp32 master
weights for bf16/fp16),
`common.pt` with `args`, `iteration`, `checkpoint_version`, the optimizer's param groups and
step, and the scheduler's state, and the RNG states. With --use-distributed-optimizer the optimizer
state is in megatron-core's `dp_reshardable` bucket form (torch_dist_buckets.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pickle
import re

import torch
from torch.distributed.checkpoint import FileSystemReader

from megatron.core.checkpointing import CheckpointError, saved_tensors, write_pieces
from megatron.core.checkpointing.megatron_buckets import BUCKET_FORM, dp_group_object_name
from megatron.core.checkpointing.megatron_lm import extra_state_objects, megatron_layout, to_megatron
from megatron.training.checkpoint.directory import (
    MEGATRON,
    METADATA,
    TRACKER,
    CheckpointInfo,
    barrier,
    global_rank,
    iteration_dir,
    prepare_staging,
    read_text,
    replace_checkpoint,
    write_text,
)
from megatron.training.checkpoint.state import checkpoint_contents
from megatron.training.checkpoint.torch_dist_args import args_mismatch, megatron_args
from megatron.training.checkpoint.torch_dist_buckets import bucket_state_pieces, buffer_dtype_pair, expert_groups
from megatron.training.checkpoint.torch_dist_common import COMMON, read_common, read_object
from megatron.training.checkpoint.torch_dist_rng import has_megatron_rng, megatron_rng_objects

MEGATRON_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
CHECKPOINT_VERSION = 3.0
CHAINED_STATE = "chained_0.optimizer.state."  # the model-space optimizer state of a ChainedOptimizer
OPTIMIZER_STATE = re.compile(r"(chained_\d+\.)?optimizer\.(state\.exp_avg\.|distributed\.)")  # moments saved


# ---- reading ---------------------------------------------------------------------------------------------


def check_file_lengths(directory: str) -> None:
    """Refuse (one line) a missing `.distcp` file or one shorter than `.metadata` says."""
    try:
        storage = FileSystemReader(directory).read_metadata().storage_data
    except (OSError, EOFError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"{os.path.join(directory, '.metadata')}: unreadable ({error})") from None
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: shard file missing")
        if os.path.getsize(path) < size:
            raise CheckpointError(
                f"{path}: {os.path.getsize(path)} bytes, the checkpoint's .metadata needs {size} (truncated)"
            )


def first_of_chain(optimizer_state) -> tuple[dict, int | None]:
    """megatron-core's ChainedOptimizer of several optimizers (with expert parallelism: the dense and the
    expert-parallel parameters', whose steps it keeps equal) records each one's common state under its
    index: (the first one's, 0); one optimizer: (its state, None)."""
    if isinstance(optimizer_state, dict) and optimizer_state and all(isinstance(k, int) for k in optimizer_state):
        return optimizer_state[0], 0
    return optimizer_state, None


def _torch_optimizer(optimizer_state) -> dict:
    """The torch optimizer's part of Megatron's optimizer common state: the state itself (fp32
    optimizer), or under `optimizer` (the bf16/fp16 one, beside `grad_scaler`)."""
    if not isinstance(optimizer_state, dict):
        return {}
    return optimizer_state["optimizer"] if isinstance(optimizer_state.get("optimizer"), dict) else optimizer_state


def _loss_scaler(optimizer_state) -> dict | None:
    """Megatron's dynamic loss scaler state (the same names as ours), None without one."""
    scaler = optimizer_state.get("grad_scaler") if isinstance(optimizer_state, dict) else None
    if not scaler or "growth_tracker" not in scaler:  # none, or a constant scale (nothing to restore)
        return None
    return {
        "scale": float(scaler["scale"]),
        "growth_tracker": int(scaler["growth_tracker"]),
        "hysteresis_tracker": int(scaler["hysteresis_tracker"]),
    }


def _step(optimizer_state) -> int | None:
    """Adam's step count in Megatron's optimizer common state (torch AdamW: `state.common_step`;
    fused Adam: the param groups' `step`)."""
    optimizer_state = _torch_optimizer(optimizer_state)
    if not optimizer_state:
        return None
    step = optimizer_state.get("state", {}).get("common_step")
    if step is None:
        steps = [g.get("step") for g in optimizer_state.get("param_groups", []) if g.get("step") is not None]
        step = steps[0] if steps else None
    return None if step is None else int(step)


def megatron_metadata(directory: str) -> dict:
    """Our checkpoint metadata (see canonical.py) for a Megatron-LM checkpoint, plus its `args`
    (`megatron_args`)."""
    common = read_common(directory)
    args = common.get("args")
    if args is None:
        raise CheckpointError(f"{os.path.join(directory, COMMON)}: no args (not a Megatron-LM training checkpoint)")
    tensors = saved_tensors(directory)
    objects = FileSystemReader(directory).read_metadata().state_dict_metadata  # tensors and byte objects
    optimizer, chained = first_of_chain(common.get("optimizer") or {})
    form = optimizer.get("param_state_sharding_type")
    if form == BUCKET_FORM:  # the param groups (with Adam's step) and loss scaler are ShardedObjects
        optimizer = {
            key: read_object(directory, dp_group_object_name(0, key, chained)) for key in ("optimizer", "grad_scaler")
        }
    step = _step(optimizer)
    moments = any(OPTIMIZER_STATE.match(name) for name in tensors)
    consumed = getattr(args, "consumed_train_samples", 0) or 0
    scheduler = common.get("opt_param_scheduler") or {}
    return {
        "consumed_samples": consumed,
        "update_samples": scheduler.get("num_steps", consumed),
        "layout": {  # the saving layout, which RNG states belong to
            "tp": args.tensor_model_parallel_size,
            "cp": getattr(args, "context_parallel_size", 1) or 1,
            "dp": getattr(args, "data_parallel_size", None),
            "pp": args.pipeline_model_parallel_size,
            "virtual_stages": getattr(args, "virtual_pipeline_model_parallel_size", None) or 1,
        },
        "optimizer": {
            "step": step or 0,
            "loss_scaler": _loss_scaler(optimizer),
            "master_weights": form == BUCKET_FORM or any(n.startswith("optimizer.state.fp32_param.") for n in tensors),
            "form": form,
        },
        "contents": ["model"]
        + (["optimizer"] if moments and step is not None else [])
        + (["rng"] if has_megatron_rng(objects) else []),
        "megatron_args": args,
        "scheduler": scheduler,
    }


def check_megatron_compatible(info: CheckpointInfo, model_config, config) -> CheckpointInfo:
    """Refuse (one line) a Megatron-LM checkpoint of another model, or without the optimizer state the
    flags ask for; returns `info` with a note that RNG states are not read."""
    metadata = info.metadata
    why = args_mismatch(metadata["megatron_args"], model_config)
    if why:
        raise CheckpointError(f"{info.directory}: {why}")
    if not (config.no_load_optim or config.finetune) and "optimizer" not in metadata["contents"]:
        raise CheckpointError(
            f"{info.directory}: holds no optimizer state; pass --no-load-optim (or --finetune) to start the "
            "optimizer fresh"
        )
    return CheckpointInfo(info.directory, info.iteration, metadata, info.notes, MEGATRON)


def megatron_checkpoint_info(root: str) -> CheckpointInfo:
    """The Megatron-LM checkpoint `root`'s tracker names, its files checked against `.metadata`."""
    iteration = int(read_text(os.path.join(root, TRACKER)))
    directory = iteration_dir(root, iteration)
    check_file_lengths(directory)
    return CheckpointInfo(directory, iteration, megatron_metadata(directory), (), MEGATRON)


# Megatron's scheduler state -> our LRSchedule field
SCHEDULE_FIELDS = {
    "max_lr": "max_lr",
    "min_lr": "min_lr",
    "lr_decay_style": "style",
    "lr_warmup_steps": "warmup_steps",
    "lr_decay_steps": "decay_steps",
}


def schedule_note(saved: dict, schedule) -> str | None:
    """A log line when the checkpoint's LR schedule differs from the flags' (ours is used; Megatron-LM
    would refuse without --override-opt_param-scheduler)."""
    if not saved or schedule is None:
        return None
    differ = [
        f"{name} {saved[name]} (flags: {getattr(schedule, ours_name)})"
        for name, ours_name in SCHEDULE_FIELDS.items()
        if name in saved and saved[name] != getattr(schedule, ours_name)
    ]
    if not differ:
        return None
    return f"> the checkpoint's LR schedule differs from the flags', which are used: {', '.join(differ)}"


def megatron_checkpoint_to_load(root: str, run) -> CheckpointInfo:
    """The Megatron-LM checkpoint `root`'s tracker names, checked against the run's flags (one line when
    it does not fit), with a note when its LR schedule differs from the flags' and the optimizer state
    is loaded."""
    info = check_megatron_compatible(megatron_checkpoint_info(root), run.model, run.checkpoint)
    if run.checkpoint.finetune or run.checkpoint.no_load_optim:
        return info
    note = schedule_note(info.metadata["scheduler"], run.lr_schedule)
    return dataclasses.replace(info, notes=info.notes + (note,)) if note else info


def stored_as_megatron(config, directory: str):
    """Our pieces of a model with TransformerConfig `config` -> the same data as pieces of Megatron-LM's
    tensors in the checkpoint `directory` (its optimizer state under a ChainedOptimizer's prefixes or not)."""
    layout = megatron_layout(config, chained=any(name.startswith(CHAINED_STATE) for name in saved_tensors(directory)))
    return lambda pieces: [to_megatron(p, layout) for p in pieces]


# ---- writing ---------------------------------------------------------------------------------------------


def _param_groups(trainer, lr: float) -> list[dict]:
    """Megatron's two param groups (weight decay on, off) as its torch AdamW records them."""
    o = trainer.run.optimizer
    groups = []
    for wd_mult in (1.0, 0.0):
        groups.append(
            {
                "lr": lr,
                "betas": (o.adam_beta1, o.adam_beta2),
                "eps": o.adam_eps,
                "weight_decay": o.weight_decay * wd_mult,
                "amsgrad": False,
                "maximize": False,
                "foreach": None,
                "capturable": False,
                "differentiable": False,
                "fused": None,
                "decoupled_weight_decay": True,
                "wd_mult": wd_mult,
                "lr_mult": 1.0,
                "is_expert_parallel": False,
                "is_decoupled_lr": False,
                "max_lr": o.lr,
                "min_lr": o.min_lr,
                "default_config": True,
            }
        )
    return groups


def _scheduler_state(trainer, update_samples: int) -> dict | None:
    schedule = trainer.run.lr_schedule
    if schedule is None:
        return None
    o = trainer.run.optimizer
    return {
        "max_lr": schedule.max_lr,
        "lr_warmup_steps": schedule.warmup_steps,
        "num_steps": update_samples,
        "lr_decay_style": schedule.style,
        "lr_decay_steps": schedule.decay_steps,
        "min_lr": schedule.min_lr,
        "start_wd": o.weight_decay,
        "end_wd": o.weight_decay,
        "wd_incr_style": "constant",
        "wd_incr_steps": schedule.decay_steps,
    }


def _common_optimizer(optimizer: dict, distributed: bool, trainer):
    """common.pt's `optimizer`: the distributed optimizer's form (its state is in ShardedObjects) or the
    optimizer's common state; with expert parallelism megatron-core's ChainedOptimizer records one per
    optimizer (dense, expert-parallel)."""
    if distributed:
        form = {"param_state_sharding_type": BUCKET_FORM}  # a dict each (megatron-core's load fills them in)
        return {0: form, 1: dict(form)} if trainer.mesh.dims.ep > 1 else form
    if trainer.mesh.dims.ep == 1:
        return optimizer
    biases = trainer.run.model.add_bias_linear
    if "optimizer" in optimizer:  # bf16/fp16: the torch optimizer's state nested beside the loss scaler
        experts = {**optimizer, "optimizer": expert_groups(optimizer["optimizer"], biases)}
    else:
        experts = expert_groups(optimizer, biases)
    return {0: optimizer, 1: copy.deepcopy(experts)}  # no shared dicts: megatron-core's load fills each in


def megatron_common(trainer, iteration: int, metadata: dict) -> dict:
    """common.pt of a Megatron-format save after `iteration` (`metadata`: our checkpoint metadata), and
    the optimizer's common state (param groups with Adam's step; bf16/fp16: nested beside the loss
    scaler, as Megatron's mixed-precision optimizer nests it) for the distributed optimizer's objects."""
    dims = trainer.mesh.dims
    distributed = trainer.run.parallel.ddp.use_distributed_optimizer
    extra = {
        "lr": trainer.run.optimizer.lr,
        "min_lr": trainer.run.optimizer.min_lr,
        "data_parallel_size": dims.dp,
        "context_parallel_size": dims.cp,
        "expert_model_parallel_size": dims.ep,
        "expert_tensor_parallel_size": dims.etp,
    }
    if distributed:  # what megatron-core's buffer layout depends on (torch_dist_buckets.our_layout)
        extra.update(
            use_distributed_optimizer=True,
            overlap_grad_reduce=False,
            ddp_bucket_size=None,
            transformer_impl="local",
            accumulate_allreduce_grads_in_fp32=buffer_dtype_pair(trainer.run.model.params_dtype)[1] == torch.float32,
        )
    args = megatron_args(
        trainer.run.model,
        iteration=iteration,
        consumed_samples=metadata["consumed_samples"],
        tp=dims.tp,
        pp=dims.pp,
        extra=extra,
    )
    step = trainer.optimizer.adam.step_count
    groups = _param_groups(trainer, trainer.learning_rates()[0])
    if distributed:  # megatron-core's DistributedOptimizer.state_dict(): the step in every group
        optimizer = {"param_groups": [{**group, "step": float(step)} for group in groups]}
    else:
        optimizer = {"param_groups": groups, "state": {"common_step": torch.tensor(float(step))}}
    if trainer.run.model.params_dtype != torch.float32 or distributed:
        optimizer = {"optimizer": optimizer}
    scaler = trainer.optimizer.grad_scaler
    if trainer.run.model.params_dtype != torch.float32 and scaler is not None:
        state = scaler.state_dict()
        optimizer["grad_scaler"] = {**state, "scale": torch.tensor([float(state["scale"])])}
    common = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "optimizer": _common_optimizer(optimizer, distributed, trainer),
        "opt_param_scheduler": _scheduler_state(trainer, metadata["update_samples"]),
        "num_floating_point_operations_so_far": 0,
    }
    if distributed or dims.ep > 1:  # as Megatron-LM records it (its optimizer state names follow from it)
        common["content_metadata"] = {"distrib_optim_sharding_type": BUCKET_FORM, "chained_optim_avoid_prefix": True}
    return common, optimizer


def publish_megatron_checkpoint(
    root: str, iteration: int, pieces: list, config, common: dict, extra: tuple[list, dict] = ((), {}), chained=False
) -> str:
    """Write our canonical `pieces` of a model with TransformerConfig `config` as Megatron-LM's torch_dist
    checkpoint `<root>/iter_NNNNNNN` (a collective, or one process): vocabulary tensors as the pieces
    have them (Megatron's padded rows at the saving tp), the layers' `_extra_state` objects, `common`
    as common.pt, and `extra` (pieces and objects already in Megatron's names: the distributed
    optimizer's buckets, RNG states); `chained`: optimizer state under a ChainedOptimizer's prefixes (expert
    parallelism). Written into a temporary directory that is renamed and only then named by the tracker, as
    ours."""
    layout = megatron_layout(config, chained)
    megatron = [to_megatron(p, layout) for p in pieces]
    extra_pieces, extra_objects = extra
    staging = prepare_staging(root, iteration)
    objects = {**extra_state_objects(pieces, layout), **extra_objects}
    write_pieces(megatron + list(extra_pieces), staging, objects=objects)
    final = iteration_dir(root, iteration)
    if global_rank() == 0:
        torch.save(common, os.path.join(staging, COMMON))
        write_text(os.path.join(staging, METADATA), json.dumps(MEGATRON_METADATA))
        replace_checkpoint(staging, final, root, iteration)
    barrier()
    return final


def save_megatron_checkpoint(root: str, iteration: int, trainer) -> str:
    """Save model and optimizer state after `iteration` as Megatron-LM's torch_dist checkpoint
    `<root>/iter_NNNNNNN` (a collective): with the distributed optimizer (any sharding strategy) in
    megatron-core's `dp_reshardable` bucket form, Megatron-LM's default. Returns the directory."""
    pieces, metadata = checkpoint_contents(trainer, iteration, rng=False)
    common, optimizer = megatron_common(trainer, iteration, metadata)
    extra_pieces, objects = [], megatron_rng_objects(trainer)
    if trainer.run.parallel.ddp.use_distributed_optimizer:
        pieces = [p for p in pieces if not p.name.startswith("optimizer.")]
        extra_pieces, buckets = bucket_state_pieces(trainer, iteration_dir(root, iteration), optimizer)
        objects.update(buckets)
    chained = trainer.mesh.dims.ep > 1
    return publish_megatron_checkpoint(
        root, iteration, pieces, trainer.run.model, common, (extra_pieces, objects), chained
    )
