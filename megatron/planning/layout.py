"""What an estimate is of besides the model: the run's own config objects and the device type.

`MemoryLayout` holds the run's ParallelConfig (with its DDPConfig) and OffloadConfig as they
are, the two batch numbers of its TrainingConfig (which, with the loop's other settings, stays
in megatron/training), whether its data makes the model build a document mask
(--reset-attention-mask, a DataConfig setting), and the one planning-only field, the device type
the estimate is for.
megatron/training/memory_check.py builds it from a RunConfig; the planner builds real config
objects for each candidate. Every estimate is a pure function of (TransformerConfig, MemoryLayout).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

from megatron.core.optimizer.config import OffloadConfig
from megatron.core.parallel_config import ParallelConfig

DEVICE_TYPES = ("cuda", "cpu")


class OffloadShares(NamedTuple):
    """The shares of the elements whose optimizer state, gradient shard and parameter shard live on host."""

    optimizer: float
    grads: float
    params: float


@dataclass(frozen=True)
class MemoryLayout:
    """`num_microbatches` is per data-parallel rank per iteration (global batch / (micro batch x
    dp)). The offload settings count only with the distributed optimizer (the offloaded state is
    each rank's shard of it); --offload-policy auto places chunks from this very estimate, so it
    is estimated with every part the strategy can move on host (full offload): the best case."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size: int = 1
    num_microbatches: int = 1
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    device_type: str = "cuda"
    document_mask: bool = False  # --reset-attention-mask: the model builds a [b, 1, s, s] mask per microbatch

    def __post_init__(self):
        for name in ("micro_batch_size", "num_microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        ddp, offload = self.parallel.ddp, self.offload
        if offload.enabled and not ddp.use_distributed_optimizer:
            raise ValueError("offload needs the distributed optimizer (the offloaded state is each rank's shard of it)")
        if offload.enabled and offload.grad_fraction and not ddp.shards_grads:
            raise ValueError("grad_offload_fraction needs a strategy that shards gradients")
        if offload.enabled and offload.param_fraction and not ddp.shards_params:
            raise ValueError("param_offload_fraction needs a strategy that shards parameters")
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(f"device_type must be one of {', '.join(DEVICE_TYPES)}, got {self.device_type!r}")

    @property
    def offload_auto(self) -> bool:
        return self.offload.enabled and self.offload.policy == "auto"

    @property
    def offload_fractions(self) -> OffloadShares:
        """What lives on host (distributed/placement.py); auto: every part the strategy can move."""
        ddp = self.parallel.ddp
        if not self.offload.enabled:
            return OffloadShares(0.0, 0.0, 0.0)
        if self.offload_auto:
            return OffloadShares(1.0, float(ddp.shards_grads), float(ddp.shards_params))
        return OffloadShares(self.offload.fraction, self.offload.grad_fraction, self.offload.param_fraction)

    def with_ddp(self, **changes) -> MemoryLayout:
        """This layout with its DDPConfig's `changes` (another sharding strategy, say)."""
        parallel = dataclasses.replace(self.parallel, ddp=dataclasses.replace(self.parallel.ddp, **changes))
        return dataclasses.replace(self, parallel=parallel)

    def replicated(self) -> MemoryLayout:
        """This run with the replicated optimizer: nothing sharded over dp x cp, nothing offloaded."""
        plain = self.with_ddp(
            use_distributed_optimizer=False,
            sharding_strategy="no_shard",
            unsharded_grad_accumulation=False,
            overlap_param_gather=False,
        )
        return dataclasses.replace(plain, offload=OffloadConfig())

    def describe(self) -> str:
        par, ddp = self.parallel, self.parallel.ddp
        text = f"TP={par.tp} CP={par.cp} PP={par.pp} DP={par.dp}"
        if par.ep > 1 or par.dims.etp != par.tp:
            text += f" EP={par.ep} ETP={par.dims.etp}"
        if par.virtual_stages > 1:
            text += f" VPP={par.virtual_stages}"
        if par.first_stage_layers is not None or par.last_stage_layers is not None:
            text += f" layers first/last={par.first_stage_layers}/{par.last_stage_layers}"
        if ddp.sharding_strategy == "optim":
            text += " distributed optimizer"
        elif ddp.use_distributed_optimizer:
            text += f" sharded {ddp.sharding_strategy}"
        optimizer, grads, params = self.offload_fractions
        if self.offload_auto:
            text += " offload auto (estimated as full offload)"
        elif optimizer:
            text += f" offload {optimizer:g}"
            if grads:
                text += f" grads {grads:g}"
            if params:
                text += f" params {params:g}"
        return text + f" micro-batch {self.micro_batch_size} x {self.num_microbatches}"

    def to_dict(self) -> dict:
        """The estimate's `--json` "layout": the settings it read, by their estimator names."""
        par, ddp = self.parallel, self.parallel.ddp
        optimizer, grads, params = self.offload_fractions
        return {
            "tp": par.tp,
            "cp": par.cp,
            "pp": par.pp,
            "dp": par.dp,
            "ep": par.ep,
            "etp": par.dims.etp,
            "virtual_stages": par.virtual_stages,
            "microbatch_group_size": par.microbatch_group_size,
            "micro_batch_size": self.micro_batch_size,
            "num_microbatches": self.num_microbatches,
            "distributed_optimizer": ddp.use_distributed_optimizer,
            "bucket_size": ddp.bucket_size,
            "first_stage_layers": par.first_stage_layers,
            "last_stage_layers": par.last_stage_layers,
            "offload_fraction": optimizer,
            "grad_offload_fraction": grads,
            "param_offload_fraction": params,
            "offload_auto": self.offload_auto,
            "grad_dtype_bytes": ddp.grad_dtype.itemsize,
            "device_type": self.device_type,
            "split_backward": par.split_backward,
            "pipeline_schedule": par.pipeline_schedule,
            "sharding_strategy": ddp.sharding_strategy,
            "reshard_after_forward": ddp.reshard_after_forward,
            "unsharded_grad_accumulation": ddp.unsharded_grad_accumulation,
            "document_mask": self.document_mask,
        }
