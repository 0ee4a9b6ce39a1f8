"""The distributed optimizer's `dp_reshardable` state of Megatron-LM's torch_dist checkpoints, read
into any of our layouts and written from ours.

Megatron-LM with `--use-distributed-optimizer` saves the optimizer state in megatron-core's bucket
form (`common.pt['optimizer']['param_state_sharding_type'] == 'dp_reshardable'`): per model-parallel
rank (pp rank x tp + tp rank) and bucket, flat fp32 tensors `param`, `exp_avg`, `exp_avg_sq` holding
each parameter's tp-local shard at an offset that megatron-core's buffer layout decides
(megatron.core.checkpointing.megatron_buckets). Adam's step and the param groups are a ShardedObject
(`optimizer.distributed.dp_group_idx_<g>.optimizer`), beside `per_bucket_numel[_unpadded]` and, for
bf16/fp16, the loss scaler.

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

import dataclasses
import functools
import math
import os
import re

import torch
import torch.distributed as dist

from megatron.core.checkpointing import CheckpointError, TensorPiece, read_pieces, saved_tensors
from megatron.core.checkpointing.megatron_buckets import (
    Bucket,
    bucket_layout,
    bucket_tensor_name,
    dp_group_object_name,
    megatron_parameter_order,
)
from megatron.core.checkpointing.pieces import box_pieces
from megatron.core.tensor_parallel.initialization import InitSpec
from megatron.training.checkpoint.torch_dist_common import read_object

STATE_OF = {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # our key -> Megatron's
OUR_STATE = re.compile(r"optimizer\.(master|exp_avg|exp_avg_sq)\.(.*)")
DTYPES = re.compile(r"optimizer\.distributed\.dp_group_idx_\d+\.gbuf_idx_0\.dtype_(.*)\.bucket_idx_\d+\.param")
EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
DEFAULT_BUCKET_ELEMENTS, BUCKET_ELEMENTS_PER_DP_RANK = 40_000_000, 1_000_000  # DistributedDataParallel


@dataclasses.dataclass(frozen=True)
class SavingLayout:
    """What megatron-core's bucket layout depends on, of the run that saved (or will load) it."""

    tp: int
    pp: int
    dp: int  # data-parallel x context-parallel size
    num_layers: int
    vocab_rows: int  # padded vocabulary rows
    tied: bool
    bucket_size: int | None = None  # elements; None: one bucket per stage
    high_busbw_padding: bool = False

    def stage_bucket_size(self, stage: int) -> int | None:
        """Buckets exist only on the first pipeline stage (DistributedDataParallel)."""
        return self.bucket_size if stage == 0 else None


def saving_layout(args, directory: str) -> SavingLayout:
    """The bucket layout parameters of the Megatron-LM run whose `args` saved `directory`; one line
    (CheckpointError) for a layout whose buckets are not built here."""
    value = functools.partial(getattr, args)
    refused = {
        "virtual pipeline stages": value("virtual_pipeline_model_parallel_size", None) not in (None, 1),
        "--decoder-first-pipeline-num-layers": value("decoder_first_pipeline_num_layers", None) is not None,
        "--decoder-last-pipeline-num-layers": value("decoder_last_pipeline_num_layers", None) is not None,
        "several distributed-optimizer instances": (value("num_distributed_optimizer_instances", 1) or 1) > 1,
        "--num-experts (the expert gradient buffers' buckets)": value("num_experts", None) is not None,
        "--transformer-impl transformer_engine (its parameter order is not checked here)": value(
            "transformer_impl", "local"
        )
        == "transformer_engine",
    }
    for what in (what for what, present in refused.items() if present):
        raise CheckpointError(
            f"{directory}: the distributed optimizer's bucket state (optimizer.distributed.*) of a run with "
            f"{what} is not read here; pass --no-load-optim"
        )
    dp = args.data_parallel_size * (getattr(args, "context_parallel_size", 1) or 1)
    bucket_size = None
    if getattr(args, "overlap_grad_reduce", False):
        bucket_size = getattr(args, "ddp_bucket_size", None) or max(
            DEFAULT_BUCKET_ELEMENTS, BUCKET_ELEMENTS_PER_DP_RANK * dp
        )
    return SavingLayout(
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        dp=dp,
        num_layers=args.num_layers,
        vocab_rows=args.padded_vocab_size,
        tied=not args.untie_embeddings_and_output_weights,
        bucket_size=bucket_size,
        high_busbw_padding=bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False)),
    )


def parameter_specs(trainer) -> dict[str, InitSpec]:
    """Every parameter's InitSpec (ours, all ranks'), keyed by canonical name; tied copies left out."""
    mine = {
        name: param.init_spec
        for chunk in trainer.chunks
        for name, param in chunk.module.named_parameters()
        if param.init_spec.seed_name is None
    }
    gathered = [mine]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    return {name: spec for specs in gathered for name, spec in specs.items()}


def _stage(name: str, layout: SavingLayout) -> int:
    if name.startswith("embedding."):
        return 0
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2]) // (layout.num_layers // layout.pp)
    return layout.pp - 1


def megatron_spec(spec: InitSpec, layout: SavingLayout, tp_rank: int) -> InitSpec:
    """The InitSpec of tp rank `tp_rank`'s shard in the saving layout (its vocabulary padding)."""
    shape = spec.full_shape
    if spec.real_rows is not None:
        shape = (layout.vocab_rows,) + tuple(shape[1:])
    shard = spec.shard and dataclasses.replace(spec.shard, num_shards=layout.tp, rank=tp_rank)
    return dataclasses.replace(spec, full_shape=shape, shard=shard, seed_name=None)


def local_shape(spec: InitSpec) -> tuple[int, ...]:
    shape = list(spec.full_shape)
    if spec.shard is not None:
        shape[spec.shard.dim] //= spec.shard.num_shards
    return tuple(shape)


def stage_buckets(specs: dict[str, InitSpec], layout: SavingLayout) -> list[tuple[list[Bucket], dict[str, InitSpec]]]:
    """Per pipeline stage of the saving layout: its buckets, and the specs of its parameters (the last
    stage's tied output layer is the embedding's copy)."""
    stages: list[dict[str, InitSpec]] = [{} for _ in range(layout.pp)]
    for name, spec in specs.items():
        stages[_stage(name, layout)][name] = spec
    shared = frozenset()
    if layout.tied and layout.pp > 1:
        stages[-1][OUTPUT] = specs[EMBEDDING]
        shared = frozenset((EMBEDDING, OUTPUT))
    out = []
    for stage, params in enumerate(stages):
        order = megatron_parameter_order(params)
        numels = [(name, math.prod(local_shape(megatron_spec(params[name], layout, 0)))) for name in order]
        buckets = bucket_layout(numels, layout.dp, layout.stage_bucket_size(stage), shared, layout.high_busbw_padding)
        out.append((buckets, params))
    return out


def buffer_dtypes(directory: str, tensors) -> str:
    """The `dtype_(param dtype, grad dtype)` part of the checkpoint's bucket tensor names."""
    found = {m.group(1) for name in tensors if (m := DTYPES.fullmatch(name))}
    if len(found) != 1:
        raise CheckpointError(
            f"{os.path.join(directory, '.metadata')}: expected the bucket tensors of one gradient buffer "
            f"(optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(...).bucket_idx_0.param), found {sorted(found)}"
        )
    return found.pop()


def check_layout(directory: str, layout: SavingLayout, stages, dtypes: str, tensors: dict) -> None:
    """One line when the checkpoint's buckets are not the ones megatron-core builds for the flags'
    model in the saving layout: their recorded lengths, or a tensor's length in `.metadata`."""
    for stage, (buckets, _) in enumerate(stages):
        expected = [b.numel_unpadded for b in buckets]
        for tp_rank in range(layout.tp):
            group = stage * layout.tp + tp_rank
            recorded = read_object(directory, dp_group_object_name(group, "per_bucket_numel_unpadded"))
            lengths = [list(d.values())[0] for d in recorded] if recorded else None
            found = [
                tensors.get(bucket_tensor_name(group, 0, dtypes, b, "param"), ((None,), None))[0][0]
                for b in range(len(buckets))
            ]
            if lengths not in (None, [expected]) or found != expected:
                raise CheckpointError(
                    f"{os.path.join(directory, '.metadata')}: the distributed optimizer's buckets of "
                    f"dp_group_idx_{group} hold {lengths[0] if lengths else found} elements, megatron-core's "
                    f"layout of the flags' model at tp {layout.tp}, pp {layout.pp}, dp x cp {layout.dp} gives "
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
    stages = stage_buckets(parameter_specs(trainer), layout)
    dtypes = buffer_dtypes(directory, tensors)
    check_layout(directory, layout, stages, dtypes, tensors)
    wanted: dict[str, dict[str, list[TensorPiece]]] = {}  # parameter -> our key -> our pieces
    for piece in pieces:
        key, name = OUR_STATE.fullmatch(piece.name).groups()
        wanted.setdefault(name, {}).setdefault(key, []).append(piece)
    reads, copies = [], []
    for stage, (buckets, specs) in enumerate(stages):
        for b, bucket in enumerate(buckets):
            for name, (start, stop) in bucket.params.items():
                for tp_rank in range(layout.tp):
                    spec = megatron_spec(specs[name], layout, tp_rank)
                    shape, group = local_shape(spec), stage * layout.tp + tp_rank
                    for key, ours in wanted.get(name, {}).items():
                        probe = box_pieces(
                            ours[0].name,
                            spec,
                            (0,) * len(shape),
                            shape,
                            torch.empty(shape, device="meta"),
                            torch.float32,
                        )
                        if not any(_intersects(piece, box) for piece in ours for box in probe):
                            continue  # this saving tp shard holds none of our state
                        flat = torch.empty(math.prod(shape))
                        boxes = box_pieces(
                            ours[0].name, spec, (0,) * len(shape), shape, flat.view(shape), torch.float32
                        )
                        source = bucket_tensor_name(group, 0, dtypes, b, STATE_OF[key])
                        reads.append(
                            TensorPiece(
                                source,
                                (bucket.numel_unpadded,),
                                (start,),
                                (stop - start,),
                                torch.float32,
                                lambda f=flat: f,
                            )
                        )
                        copies += [(piece, box) for piece in ours for box in boxes]
    read_pieces(reads, directory)
    for piece, box in copies:
        _overlap(piece, box)


def _intersects(a: TensorPiece, b: TensorPiece) -> bool:
    return all(max(x, y) < min(x + n, y + m) for x, n, y, m in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def our_layout(trainer, directory: str) -> SavingLayout:
    """The bucket layout parameters of our run, as Megatron-LM without `--overlap-grad-reduce` would
    build them at our tp, pp and dp x cp; one line for a layout Megatron's stages cannot express."""
    run, dims = trainer.run, trainer.mesh.dims
    parallel = run.parallel
    if parallel.virtual_stages > 1 or parallel.first_stage_layers or parallel.last_stage_layers:
        raise CheckpointError(
            f"{directory}: the distributed optimizer's torch_dist form is written only for even pipeline stages "
            "without virtual stages; save with --ckpt-format canonical (or without --use-distributed-optimizer)"
        )
    return SavingLayout(
        tp=dims.tp,
        pp=dims.pp,
        dp=dims.dp * dims.cp,
        num_layers=run.model.num_layers,
        vocab_rows=run.model.padded_vocab_size,
        tied=not run.model.untie_embeddings_and_output_weights,
    )


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


def bucket_state_pieces(trainer, directory: str, optimizer_objects: dict) -> tuple[list[TensorPiece], dict]:
    """This rank's optimizer state as pieces of Megatron-LM's bucket tensors, and the ShardedObjects of
    its model-parallel rank (`optimizer_objects`: the `optimizer` and, for bf16/fp16, `grad_scaler`
    states), for `write_pieces` (a collective: every rank's parameter specs are gathered)."""
    layout = our_layout(trainer, directory)
    stages = stage_buckets(parameter_specs(trainer), layout)
    mesh = trainer.mesh
    group = mesh.pp_rank * layout.tp + mesh.tp_rank
    buckets, _ = stages[mesh.pp_rank]
    dtypes = buffer_dtype_pair(trainer.run.model.params_dtype)
    where = {name: (b, span) for b, bucket in enumerate(buckets) for name, span in bucket.params.items()}
    pieces = []
    for name, ranges in trainer.optimizer.state_dict_by_name().items():
        if name == "step":
            continue
        if name not in where:
            raise CheckpointError(f"{directory}: {name} is not on Megatron's pipeline stage {mesh.pp_rank}")
        b, (start, _) = where[name]
        for offset, numel, views in ranges:
            for key, theirs in STATE_OF.items():
                pieces.append(
                    TensorPiece(
                        bucket_tensor_name(group, 0, dtypes, b, theirs),
                        (buckets[b].numel_unpadded,),
                        (start + offset,),
                        (numel,),
                        torch.float32,
                        lambda view=views[key]: view,
                    )
                )
    for b, bucket in enumerate(buckets):  # alignment gaps: zeros, so that every tensor is covered
        for start, stop in _gaps(bucket):
            zeros = torch.zeros(stop - start)
            for theirs in STATE_OF.values():
                name = bucket_tensor_name(group, 0, dtypes, b, theirs)
                pieces.append(
                    TensorPiece(
                        name, (bucket.numel_unpadded,), (start,), (stop - start,), torch.float32, lambda z=zeros: z
                    )
                )
    objects = {
        "per_bucket_numel": [{dtypes: [b.numel for b in buckets]}],
        "per_bucket_numel_unpadded": [{dtypes: [b.numel_unpadded for b in buckets]}],
        **optimizer_objects,
    }
    return pieces, {dp_group_object_name(group, key): [value] for key, value in objects.items()}
