"""Run-level config: the parallel layout from the command line (the dataclass is
megatron/core/parallel_config.py), the training loop's settings, the whole run."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.core.distributed.model_chunk_buffers import DDPConfig
from megatron.core.optimizer.config import OptimizerConfig
from megatron.core.optimizer.lr_schedule import LRSchedule
from megatron.core.parallel_config import ParallelConfig
from megatron.core.parallel_state import ParallelDims
from megatron.core.pipeline_parallel.layer_split import layers_per_rank
from megatron.core.transformer.config import TransformerConfig
from megatron.data.config import DataConfig
from megatron.training.arguments.checkpoint import CheckpointConfig
from megatron.training.arguments.evaluation import EvalConfig
from megatron.training.arguments.logging import LoggingConfig
from megatron.training.arguments.parallel import (
    rank_order_from_args,
    reshard_after_forward_from_args,
    sharding_strategy_from_args,
    unsharded_grad_accumulation_from_args,
)
from megatron.training.batch_schedule import BatchSizeSchedule


def parallel_config_from_args(args, world_size: int) -> ParallelConfig:
    """The parallel layout of Megatron's flags (one ValueError line naming the flag if invalid)."""
    dims = ParallelDims.from_world(
        world_size,
        tp=args.tensor_model_parallel_size,
        cp=args.context_parallel_size,
        pp=args.pipeline_model_parallel_size,
        order=rank_order_from_args(args),
        ep=args.expert_model_parallel_size,
        etp=args.expert_tensor_parallel_size,
    )
    virtual = _virtual_stages(args, dims.pp)
    if args.pipeline_schedule == "zbv":
        virtual = _zbv_virtual_stages(args, dims.pp, virtual)
    if args.distributed_timeout_minutes < 1:
        raise ValueError("--distributed-timeout-minutes must be >= 1")
    if not args.heartbeat_timeout_seconds >= 0:
        raise ValueError(f"--heartbeat-timeout-seconds must be >= 0 (0 disables), got {args.heartbeat_timeout_seconds}")
    schedule = _pipeline_schedule(args.pipeline_schedule, dims.pp, virtual)
    if args.split_backward and dims.pp == 1:
        raise ValueError(
            "--split-backward only changes pipeline schedules: it needs --pipeline-model-parallel-size > 1"
        )
    ddp = DDPConfig(
        bucket_size=args.ddp_bucket_size,
        sharding_strategy=sharding_strategy_from_args(args),
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        reshard_after_forward=reshard_after_forward_from_args(args, dims.pp),
        unsharded_grad_accumulation=unsharded_grad_accumulation_from_args(args),
    )
    return ParallelConfig(
        tp=dims.tp,
        cp=dims.cp,
        pp=dims.pp,
        dp=dims.dp,
        virtual_stages=virtual,
        microbatch_group_size=args.microbatch_group_size_per_virtual_pipeline_stage,
        backend=args.distributed_backend,
        timeout_minutes=args.distributed_timeout_minutes,
        ddp=ddp,
        first_stage_layers=args.decoder_first_pipeline_num_layers,
        last_stage_layers=args.decoder_last_pipeline_num_layers,
        rank_order=dims.order,
        split_backward=args.split_backward,
        pipeline_schedule=schedule,
        heartbeat_timeout=args.heartbeat_timeout_seconds,
        ep=dims.ep,
        etp=dims.etp,
    )


def _pipeline_schedule(name: str | None, pp: int, virtual: int) -> str:
    """--pipeline-schedule checked against the layout (None: 'auto', the schedule the layout implies)."""
    if name is None:
        return "auto"
    if pp == 1:
        raise ValueError(f"--pipeline-schedule {name} needs --pipeline-model-parallel-size > 1")
    if name == "zbv":
        return name
    interleaved = name.startswith("interleaved")
    if interleaved and virtual == 1:
        raise ValueError(
            f"--pipeline-schedule {name} runs several model chunks per rank: give "
            "--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank"
        )
    if not interleaved and virtual > 1:
        other = "interleaved-zb" if name == "zb-h1" else "interleaved"
        raise ValueError(
            f"--pipeline-schedule {name} runs one model chunk per rank, but virtual pipeline stages "
            f"are given ({virtual} per rank); use --pipeline-schedule {other}"
        )
    return name


def _zbv_virtual_stages(args, pp: int, virtual: int) -> int:
    """zbv runs exactly two model chunks per rank (the V): implied when no virtual-stage flag is given."""
    if pp == 1:
        raise ValueError("--pipeline-schedule zbv needs --pipeline-model-parallel-size > 1")
    if args.microbatch_group_size_per_virtual_pipeline_stage is not None:
        raise ValueError(
            "--microbatch-group-size-per-virtual-pipeline-stage applies to the interleaved schedules, "
            "not to --pipeline-schedule zbv (its order is fixed by the V)"
        )
    given = (
        args.num_layers_per_virtual_pipeline_stage is not None or args.num_virtual_stages_per_pipeline_rank is not None
    )
    if given and virtual != 2:
        raise ValueError(
            f"--pipeline-schedule zbv runs exactly 2 model chunks per pipeline rank (V placement), but "
            f"--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank give {virtual}; "
            "leave them out or give 2 virtual stages"
        )
    return 2


def _virtual_stages(args, pp: int) -> int:
    per_stage, per_rank = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    if per_stage is not None and per_rank is not None:
        raise ValueError(
            "give only one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank"
        )
    if per_stage is None and per_rank is None:
        return 1
    if pp == 1:
        raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
    if per_rank is not None:
        if per_rank < 1:
            raise ValueError("--num-virtual-stages-per-pipeline-rank must be >= 1")
        return per_rank
    if per_stage < 1:
        raise ValueError("--num-layers-per-virtual-pipeline-stage must be >= 1")
    counts = layers_per_rank(
        args.num_layers, pp, args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    )
    if len(set(counts)) > 1:
        raise ValueError(
            "--num-layers-per-virtual-pipeline-stage needs equal layers per pipeline rank; with "
            "--decoder-first/last-pipeline-num-layers use --num-virtual-stages-per-pipeline-rank"
        )
    if counts[0] % per_stage:
        raise ValueError(
            f"--num-layers ({args.num_layers}) / --pipeline-model-parallel-size ({pp}) must be a "
            f"multiple of --num-layers-per-virtual-pipeline-stage ({per_stage})"
        )
    return counts[0] // per_stage


@dataclass
class TrainingConfig:
    micro_batch_size: int
    global_batch_size: int  # the final one when the batch grows (--rampup-batch-size, step schedule)
    num_microbatches: int  # of global_batch_size
    train_iters: int
    seed: int
    log_interval: int
    tensorboard_dir: str | None
    device_memory_gb: float | None = None
    host_memory_gb: float | None = None  # per rank; None: available memory / ranks on the node
    skip_memory_check: bool = False
    batch_schedule: BatchSizeSchedule | None = None
    train_samples: int | None = None
    deterministic: bool = False

    def __post_init__(self):
        if self.batch_schedule is None:
            self.batch_schedule = BatchSizeSchedule(self.global_batch_size)


@dataclass
class RunConfig:
    model: TransformerConfig
    optimizer: OptimizerConfig
    parallel: ParallelConfig
    training: TrainingConfig
    sequence_parallel_requested: bool = False
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lr_schedule: LRSchedule | None = None  # None: constant at optimizer.lr
    decoupled_lr_schedule: LRSchedule | None = None  # embedding and output layer (--decoupled-lr)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    notes: list = field(default_factory=list)  # start-up lines about flags accepted without effect
    data: DataConfig | None = None  # None: --mock-data
    evaluation: EvalConfig = field(default_factory=EvalConfig)
