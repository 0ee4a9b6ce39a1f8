"""Where megatron-core's distributed optimizer keeps each parameter's state in a `dp_reshardable`
torch_dist checkpoint, for a saving (or loading) layout: its gradient buffers, each one model-parallel
rank's, with their buckets (megatron.core.checkpointing.megatron_buckets) and the shard of each
parameter they hold.

Without expert parallelism (ep 1) every parameter, routed experts included, sits in one buffer per
model-parallel rank (`dp_group_idx` = pp rank x tp + tp rank), sharded over dp x cp. With expert
parallelism megatron-core builds two distributed optimizers (a ChainedOptimizer, whose checkpoint names
start with `chained_0.` and `chained_1.`): the dense parameters' buffers as before, and the routed
experts' buffers, one per expert model-parallel rank (`dp_group_idx` = (pp rank x ep + ep rank) x etp
+ etp rank: the rank in megatron-core's expert tensor-model-pipeline group), holding that ep rank's
experts (in local index order, the order of their global indices), each split over etp, sharded over
the expert data-parallel size tp x dp x cp / (ep x etp).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch.distributed as dist

from megatron.core.checkpointing import CheckpointError
from megatron.core.checkpointing.megatron_buckets import Bucket, bucket_layout, megatron_parameter_order
from megatron.core.checkpointing.megatron_lm import EXPERT
from megatron.core.tensor_parallel.initialization import InitSpec

EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
DEFAULT_BUCKET_ELEMENTS, BUCKET_ELEMENTS_PER_DP_RANK = 40_000_000, 1_000_000  # DistributedDataParallel
DENSE, EXPERTS = 0, 1  # the ChainedOptimizer's index of each with expert parallelism


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
    ep: int = 1  # expert model parallel
    etp: int = 1  # expert tensor parallel
    num_experts: int | None = None

    def stage_bucket_size(self, stage: int) -> int | None:
        """Buckets exist only on the first pipeline stage (DistributedDataParallel)."""
        return self.bucket_size if stage == 0 else None

    @property
    def edp(self) -> int:
        """Expert data parallel: the ranks the expert buffers are sharded over."""
        return self.tp * self.dp // (self.ep * self.etp)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One gradient buffer of one model-parallel rank: its ChainedOptimizer index (None: one optimizer),
    `dp_group_idx`, buckets, and the InitSpec of the shard it holds of each of its parameters."""

    chained: int | None
    group: int
    buckets: list[Bucket]
    specs: dict[str, InitSpec]


def _experts(what: str, ep: int, etp: int, tp: int, directory: str) -> None:
    """One line for an expert layout whose buffers are not built here: without expert parallelism
    megatron-core keeps the experts in the dense buffers, split over tp, not etp."""
    if ep == 1 and etp != tp:
        raise CheckpointError(
            f"{directory}: the distributed optimizer's bucket state of {what} with --expert-tensor-parallel-size "
            f"{etp} != --tensor-model-parallel-size {tp} and no expert parallelism is not handled here"
        )


def saving_layout(args, directory: str) -> SavingLayout:
    """The bucket layout parameters of the Megatron-LM run whose `args` saved `directory`; one line
    (CheckpointError) for a layout whose buckets are not built here."""
    value = functools.partial(getattr, args)
    local = value("transformer_impl", "local") != "transformer_engine"
    refused = {
        "virtual pipeline stages": value("virtual_pipeline_model_parallel_size", None) not in (None, 1),
        "--decoder-first-pipeline-num-layers": value("decoder_first_pipeline_num_layers", None) is not None,
        "--decoder-last-pipeline-num-layers": value("decoder_last_pipeline_num_layers", None) is not None,
        "several distributed-optimizer instances": (value("num_distributed_optimizer_instances", 1) or 1) > 1,
        "--transformer-impl transformer_engine (its parameter order is not checked here)": not local,
        "--moe-grouped-gemm (the local GroupedMLP's weight1/weight2 buffers)": bool(value("moe_grouped_gemm", False)),
    }
    for what in (what for what, present in refused.items() if present):
        raise CheckpointError(
            f"{directory}: the distributed optimizer's bucket state (optimizer.distributed.*) of a run with "
            f"{what} is not read here; pass --no-load-optim"
        )
    tp = args.tensor_model_parallel_size
    ep = value("expert_model_parallel_size", 1) or 1
    etp = value("expert_tensor_parallel_size", None) or tp
    _experts("a run", ep, etp, tp, directory)
    dp = args.data_parallel_size * (getattr(args, "context_parallel_size", 1) or 1)
    bucket_size = None
    if getattr(args, "overlap_grad_reduce", False):
        bucket_size = getattr(args, "ddp_bucket_size", None) or max(
            DEFAULT_BUCKET_ELEMENTS, BUCKET_ELEMENTS_PER_DP_RANK * dp
        )
    return SavingLayout(
        tp=tp,
        pp=args.pipeline_model_parallel_size,
        dp=dp,
        num_layers=args.num_layers,
        vocab_rows=args.padded_vocab_size,
        tied=not args.untie_embeddings_and_output_weights,
        bucket_size=bucket_size,
        high_busbw_padding=bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False)),
        ep=ep,
        etp=etp,
        num_experts=value("num_experts", None),
    )


def our_layout(trainer, directory: str) -> SavingLayout:
    """The bucket layout parameters of our run, as Megatron-LM without `--overlap-grad-reduce` would
    build them at our tp, pp, dp x cp, ep and etp; one line for a layout Megatron's stages cannot express."""
    run, dims = trainer.run, trainer.mesh.dims
    parallel = run.parallel
    if parallel.virtual_stages > 1 or parallel.first_stage_layers or parallel.last_stage_layers:
        raise CheckpointError(
            f"{directory}: the distributed optimizer's torch_dist form is written only for even pipeline stages "
            "without virtual stages (--pipeline-schedule zbv has two per rank); save with --ckpt-format canonical "
            "(or without --use-distributed-optimizer)"
        )
    _experts("our run", dims.ep, dims.etp, dims.tp, directory)
    return SavingLayout(
        tp=dims.tp,
        pp=dims.pp,
        dp=dims.dp * dims.cp,
        num_layers=run.model.num_layers,
        vocab_rows=run.model.padded_vocab_size,
        tied=not run.model.untie_embeddings_and_output_weights,
        ep=dims.ep,
        etp=dims.etp,
        num_experts=run.model.num_moe_experts,
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


def megatron_spec(spec: InitSpec, vocab_rows: int, shards: int, rank: int) -> InitSpec:
    """The InitSpec of shard `rank` of `shards` (tp or etp) in the saving layout (its vocabulary padding)."""
    shape = spec.full_shape
    if spec.real_rows is not None:
        shape = (vocab_rows,) + tuple(shape[1:])
    shard = spec.shard and dataclasses.replace(spec.shard, num_shards=shards, rank=rank)
    return dataclasses.replace(spec, full_shape=shape, shard=shard, seed_name=None)


def local_shape(spec: InitSpec) -> tuple[int, ...]:
    shape = list(spec.full_shape)
    if spec.shard is not None:
        shape[spec.shard.dim] //= spec.shard.num_shards
    return tuple(shape)


def _buffer(chained, group, specs, dp: int, bucket_size, shared, high_busbw_padding) -> Buffer:
    numels = [(name, math.prod(local_shape(specs[name]))) for name in megatron_parameter_order(specs)]
    return Buffer(chained, group, bucket_layout(numels, dp, bucket_size, shared, high_busbw_padding), specs)


def saving_buffers(specs: dict[str, InitSpec], layout: SavingLayout) -> list[Buffer]:
    """Every model-parallel rank's buffers in the saving layout (see module doc); `specs`: every
    parameter's (ours). The last stage's tied output layer is the embedding's copy."""
    stages: list[dict[str, InitSpec]] = [{} for _ in range(layout.pp)]
    for name, spec in specs.items():
        stages[_stage(name, layout)][name] = spec
    shared = frozenset()
    if layout.tied and layout.pp > 1:
        stages[-1][OUTPUT] = specs[EMBEDDING]
        shared = frozenset((EMBEDDING, OUTPUT))
    expert_parallel = layout.ep > 1
    out = []
    for stage, params in enumerate(stages):
        size, padding = layout.stage_bucket_size(stage), layout.high_busbw_padding
        experts = {name: EXPERT.search(name) for name in params}
        dense = {name: spec for name, spec in params.items() if not (expert_parallel and experts[name])}
        for tp_rank in range(layout.tp):
            mine = {name: megatron_spec(spec, layout.vocab_rows, layout.tp, tp_rank) for name, spec in dense.items()}
            chained = DENSE if expert_parallel else None
            out.append(_buffer(chained, stage * layout.tp + tp_rank, mine, layout.dp, size, shared, padding))
        if not expert_parallel:
            continue
        per_rank = layout.num_experts // layout.ep
        for ep_rank in range(layout.ep):
            local = {n: s for n, s in params.items() if experts[n] and int(experts[n].group(1)) // per_rank == ep_rank}
            for etp_rank in range(layout.etp if local else 0):
                mine = {n: megatron_spec(spec, layout.vocab_rows, layout.etp, etp_rank) for n, spec in local.items()}
                group = (stage * layout.ep + ep_rank) * layout.etp + etp_rank
                out.append(_buffer(EXPERTS, group, mine, layout.edp, size, frozenset(), padding))
    return out
