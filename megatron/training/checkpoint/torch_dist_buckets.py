"""The distributed optimizer's `dp_reshardable` state of Megatron-LM's torch_dist checkpoints, read
into any of our layouts and written from ours.

Megatron-LM with `--use-distributed-optimizer` saves the optimizer state in megatron-core's bucket
form (`common.pt['optimizer']['param_state_sharding_type'] == 'dp_reshardable'`): per model-parallel
rank (pp rank x tp + tp rank) and bucket, flat fp32 tensors `param`, `exp_avg`, `exp_avg_sq` holding
each parameter's tp-local shard at an offset that megatron-core's buffer layout decides
(megatron.core.checkpointing.megatron_buckets). Adam's step and the param groups are a ShardedObject
(`optimizer.distributed.dp_group_idx_<g>.optimizer`), beside `per_bucket_numel[_unpadded]` and, for
bf16/fp16, the loss scaler.

MoE models: with expert parallelism the routed experts have buffers of their own and every name is prefixed by
its optimizer's index in megatron-core's ChainedOptimizer (torch_dist_bucket_layout.py).

Reading: every rank learns every parameter's InitSpec (one all_gather of names and specs), rebuilds
the saving run's buckets from its `args` (tp, pp, dp x cp, bucket size), checks them against the
checkpoint's `per_bucket_numel_unpadded` and tensor lengths, reads the saving tp shards that overlap
its own optimizer state (whole shards: memory is at most the saving layout's share of the model
per rank) and copies the overlaps into its canonical state pieces. Any of our layouts and sharding
strategies reads it, as they read canonical state.

Writing (`--ckpt-format torch_dist --use-distributed-optimizer`): each rank writes the ranges of its
local parameters' state at their places in the buckets of our layout (tp, pp, dp x cp; one bucket per
stage, as Megatron-LM without `--overlap-grad-reduce`); the 64-element alignment gaps are written as
zeros so that every bucket tensor is covered, as megatron-core covers them with padding.
"""

from __future__ import annotations

import math
import os
import re

import torch

from megatron.core.checkpointing import CheckpointError, TensorPiece, read_pieces, saved_tensors
from megatron.core.checkpointing.megatron_buckets import Bucket, bucket_tensor_name, dp_group_object_name
from megatron.core.checkpointing.pieces import box_pieces
from megatron.training.checkpoint.torch_dist_bucket_layout import (
    EXPERTS,
    Buffer,
    SavingLayout,
    local_shape,
    our_layout,
    parameter_specs,
    saving_buffers,
    saving_layout,
)
from megatron.training.checkpoint.torch_dist_common import read_object

STATE_OF = {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # our key -> Megatron's
OUR_STATE = re.compile(r"optimizer\.(master|exp_avg|exp_avg_sq)\.(.*)")
DTYPES = re.compile(
    r"(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\.gbuf_idx_0\.dtype_(.*)\.bucket_idx_\d+\.param"
)


def buffer_dtypes(directory: str, tensors) -> str:
    """The `dtype_(param dtype, grad dtype)` part of the checkpoint's bucket tensor names."""
    found = {m.group(1) for name in tensors if (m := DTYPES.fullmatch(name))}
    if len(found) != 1:
        raise CheckpointError(
            f"{os.path.join(directory, '.metadata')}: expected the bucket tensors of one gradient buffer "
            f"(optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(...).bucket_idx_0.param), found {sorted(found)}"
        )
    return found.pop()


def check_layout(directory: str, layout: SavingLayout, buffers: list[Buffer], dtypes: str, tensors: dict) -> None:
    """One line when the checkpoint's buckets are not the ones megatron-core builds for the flags'
    model in the saving layout: their recorded lengths, or a tensor's length in `.metadata`."""
    for buffer in buffers:
        expected = [b.numel_unpadded for b in buffer.buckets]
        recorded = read_object(
            directory, dp_group_object_name(buffer.group, "per_bucket_numel_unpadded", buffer.chained)
        )
        lengths = [list(d.values())[0] for d in recorded] if recorded else None
        found = [
            tensors.get(bucket_tensor_name(buffer.group, 0, dtypes, b, "param", buffer.chained), ((None,), None))[0][0]
            for b in range(len(buffer.buckets))
        ]
        if lengths not in (None, [expected]) or found != expected:
            name = ("" if buffer.chained is None else f"chained_{buffer.chained}.") + f"dp_group_idx_{buffer.group}"
            raise CheckpointError(
                f"{os.path.join(directory, '.metadata')}: the distributed optimizer's buckets of {name} hold "
                f"{lengths[0] if lengths else found} elements, megatron-core's layout of the flags' model at tp "
                f"{layout.tp}, pp {layout.pp}, dp x cp {layout.dp}, ep {layout.ep}, etp {layout.etp} gives "
                f"{expected} (a corrupt checkpoint or another model)"
            )


def _overlap(dst: TensorPiece, src: TensorPiece) -> None:
    """Copy the box where `src` and `dst` (pieces of one tensor) overlap from `src` into `dst`."""
    lo = [max(a, b) for a, b in zip(dst.offsets, src.offsets)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(dst.offsets, dst.sizes, src.offsets, src.sizes)]
    if all(h > low for low, h in zip(lo, hi)):
        dst.tensor()[tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, dst.offsets))].copy_(
            src.tensor()[tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, src.offsets))]
        )


def read_bucket_state(directory: str, args, trainer, pieces: list[TensorPiece]) -> None:
    """Fill our canonical optimizer state `pieces` (`optimizer.{master,exp_avg,exp_avg_sq}.<name>`) from
    the bucket form of the checkpoint in `directory`, saved with Megatron-LM's `args` (a collective)."""
    tensors = saved_tensors(directory)
    layout = saving_layout(args, directory)
    buffers = saving_buffers(parameter_specs(trainer), layout)
    dtypes = buffer_dtypes(directory, tensors)
    check_layout(directory, layout, buffers, dtypes, tensors)
    wanted: dict[str, dict[str, list[TensorPiece]]] = {}  # parameter -> our key -> our pieces
    for piece in pieces:
        key, name = OUR_STATE.fullmatch(piece.name).groups()
        wanted.setdefault(name, {}).setdefault(key, []).append(piece)
    reads, copies = [], []
    for buffer in buffers:
        for b, bucket in enumerate(buffer.buckets):
            for name, (start, stop) in bucket.params.items():
                spec = buffer.specs[name]
                shape = local_shape(spec)
                for key, ours in wanted.get(name, {}).items():
                    probe = box_pieces(
                        ours[0].name, spec, (0,) * len(shape), shape, torch.empty(shape, device="meta"), torch.float32
                    )
                    if not any(_intersects(piece, box) for piece in ours for box in probe):
                        continue  # this saving shard holds none of our state
                    flat = torch.empty(math.prod(shape))
                    boxes = box_pieces(ours[0].name, spec, (0,) * len(shape), shape, flat.view(shape), torch.float32)
                    source = bucket_tensor_name(buffer.group, 0, dtypes, b, STATE_OF[key], buffer.chained)
                    reads.append(
                        TensorPiece(
                            source, (bucket.numel_unpadded,), (start,), (stop - start,), torch.float32, lambda f=flat: f
                        )
                    )
                    copies += [(piece, box) for piece in ours for box in boxes]
    read_pieces(reads, directory)
    for piece, box in copies:
        _overlap(piece, box)


def _intersects(a: TensorPiece, b: TensorPiece) -> bool:
    return all(max(x, y) < min(x + n, y + m) for x, n, y, m in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def buffer_dtype_pair(params_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(param dtype, grad dtype) of Megatron-LM's buffer: fp32 gradients for fp32 and bf16 weights
    (bf16 forces --accumulate-allreduce-grads-in-fp32), fp16 gradients for fp16 weights (its default)."""
    return params_dtype, torch.float16 if params_dtype == torch.float16 else torch.float32


def _gaps(bucket: Bucket) -> list[tuple[int, int]]:
    """The [start, stop) ranges of the bucket's unpadded length that hold no parameter."""
    gaps, position = [], 0
    for start, stop in sorted(bucket.params.values()):
        if start > position:
            gaps.append((position, start))
        position = stop
    return gaps


def _my_buffers(trainer, layout: SavingLayout, buffers: list[Buffer]) -> list[Buffer]:
    """This rank's buffers: its model-parallel rank's dense one and, with expert parallelism, its expert
    model-parallel rank's (when its stage has experts)."""
    mesh = trainer.mesh
    expert = mesh.dims.expert_coords(mesh.rank)
    groups = {
        (None if layout.ep == 1 else 0, mesh.pp_rank * layout.tp + mesh.tp_rank),
        (EXPERTS, (mesh.pp_rank * layout.ep + expert["ep"]) * layout.etp + expert["etp"]),
    }
    return [buffer for buffer in buffers if (buffer.chained, buffer.group) in groups]


def expert_groups(optimizer: dict, biases: bool) -> dict:
    """The expert-parallel optimizer's state dict (param groups, step) from the dense one's: its param groups
    say so, and hold the weight-decay-free group only where experts have `biases` (megatron-core builds the
    groups its parameters need; its non-distributed optimizer's load wants as many)."""
    groups = [{**g, "is_expert_parallel": True} for g in optimizer["param_groups"] if g["wd_mult"] or biases]
    return {**optimizer, "param_groups": groups}


def _gap_pieces(buffer: Buffer, dtypes) -> list[TensorPiece]:
    """Zeros in the alignment gaps of a buffer's buckets, so that every bucket tensor is covered."""
    pieces = []
    for b, bucket in enumerate(buffer.buckets):
        for start, stop in _gaps(bucket):
            zeros = torch.zeros(stop - start)
            for theirs in STATE_OF.values():
                name = bucket_tensor_name(buffer.group, 0, dtypes, b, theirs, buffer.chained)
                pieces.append(
                    TensorPiece(
                        name, (bucket.numel_unpadded,), (start,), (stop - start,), torch.float32, lambda z=zeros: z
                    )
                )
    return pieces


def bucket_state_pieces(trainer, directory: str, optimizer_objects: dict) -> tuple[list[TensorPiece], dict]:
    """This rank's optimizer state as pieces of Megatron-LM's bucket tensors, and the ShardedObjects of
    its model-parallel ranks (`optimizer_objects`: the `optimizer` and, for bf16/fp16, `grad_scaler`
    states), for `write_pieces` (a collective: every rank's parameter specs are gathered)."""
    layout = our_layout(trainer, directory)
    buffers = _my_buffers(trainer, layout, saving_buffers(parameter_specs(trainer), layout))
    dtypes = buffer_dtype_pair(trainer.run.model.params_dtype)
    biases = trainer.run.model.add_bias_linear
    where = {
        name: (buffer, b, span)
        for buffer in buffers
        for b, bucket in enumerate(buffer.buckets)
        for name, span in bucket.params.items()
    }
    pieces = []
    for name, ranges in trainer.optimizer.state_dict_by_name().items():
        if name == "step":
            continue
        if name not in where:
            raise CheckpointError(f"{directory}: {name} is not on Megatron's pipeline stage {trainer.mesh.pp_rank}")
        buffer, b, (start, _) = where[name]
        for offset, numel, views in ranges:
            for key, theirs in STATE_OF.items():
                pieces.append(
                    TensorPiece(
                        bucket_tensor_name(buffer.group, 0, dtypes, b, theirs, buffer.chained),
                        (buffer.buckets[b].numel_unpadded,),
                        (start + offset,),
                        (numel,),
                        torch.float32,
                        lambda view=views[key]: view,
                    )
                )
    objects = {}
    for buffer in buffers:
        pieces += _gap_pieces(buffer, dtypes)
        values = {
            "per_bucket_numel": [{dtypes: [b.numel for b in buffer.buckets]}],
            "per_bucket_numel_unpadded": [{dtypes: [b.numel_unpadded for b in buffer.buckets]}],
            **optimizer_objects,
            **(
                {"optimizer": expert_groups(optimizer_objects["optimizer"], biases)}
                if buffer.chained == EXPERTS
                else {}
            ),
        }
        objects.update({dp_group_object_name(buffer.group, k, buffer.chained): [v] for k, v in values.items()})
    return pieces, objects
