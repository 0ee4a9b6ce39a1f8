"""What the estimator needs besides the model config: the parallel layout, the batch and the device.

`MemoryLayout` is built from a RunConfig by megatron/training/memory_check.py, or
directly by the planner; it holds only numbers, so every estimate is a pure
function of (TransformerConfig, MemoryLayout).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.distributed.bucket_layout import STRATEGIES

DEVICE_TYPES = ("cuda", "cpu")


@dataclass(frozen=True)
class MemoryLayout:
    """Parallel sizes, batch, and what runs where.

    `num_microbatches` is per data-parallel rank per iteration
    (global batch / (micro batch x dp)). `grad_dtype_bytes` is the element size of
    the DDP gradient buffer (`main_grad`; fp32 in our trainer whatever the weights).
    `distributed_optimizer` shards optimizer state over dp x cp, in buckets of
    `bucket_size` elements (None: the trainer's default for dp x cp ranks), because
    each bucket is padded before it is split (megatron/core/distributed/bucket_layout.py).
    `first_stage_layers` / `last_stage_layers`: an uneven pipeline split
    (--decoder-first/last-pipeline-num-layers). `offload_fraction`: the offload optimizer's
    --optimizer-offload-fraction (0: no offload), rounded to whole chunks as the static policy
    rounds it (memory/offload.py). `grad_offload_fraction` / `param_offload_fraction`: the share
    of the elements whose gradient / parameter shard also lives on host (--grad-offload-fraction,
    --param-offload-fraction; distributed/placement.py). `offload_auto`: --offload-policy auto,
    which places chunks from this very estimate, so it is estimated with every part the strategy
    can move on host (full offload): the best case.
    `split_backward`: the pipeline's --split-backward (linear layers queue their output
    gradients until the chunk's weight step). `sharding_strategy`: what is sharded over dp x cp
    (--data-parallel-sharding-strategy); `distributed_optimizer` alone means "optim", and is
    set whenever the strategy shards anything. `reshard_after_forward` (optim_grads_params,
    --reshard-params-after-forward): None means the trainer's default, on without pipeline
    parallelism. `unsharded_grad_accumulation` (--unsharded-grad-accumulation): sharded
    gradients kept whole across the microbatches and reduce-scattered once per step.
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    virtual_stages: int = 1
    microbatch_group_size: int | None = None
    micro_batch_size: int = 1
    num_microbatches: int = 1
    distributed_optimizer: bool = False
    bucket_size: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    offload_fraction: float = 0.0
    grad_offload_fraction: float = 0.0
    param_offload_fraction: float = 0.0
    offload_auto: bool = False
    grad_dtype_bytes: int = 4
    device_type: str = "cuda"
    split_backward: bool = False
    sharding_strategy: str = "no_shard"
    reshard_after_forward: bool | None = None
    unsharded_grad_accumulation: bool = False

    def __post_init__(self):
        if self.sharding_strategy not in STRATEGIES:
            raise ValueError(
                f"sharding_strategy must be one of {', '.join(STRATEGIES)}, got {self.sharding_strategy!r}"
            )
        if self.distributed_optimizer and self.sharding_strategy == "no_shard":
            object.__setattr__(self, "sharding_strategy", "optim")
        object.__setattr__(self, "distributed_optimizer", self.sharding_strategy != "no_shard")
        for name in ("tp", "cp", "pp", "dp", "virtual_stages", "micro_batch_size", "num_microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.virtual_stages > 1 and self.pp == 1:
            raise ValueError("virtual pipeline stages need a pipeline-parallel size > 1")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1, got {self.bucket_size}")
        if not 0.0 <= self.offload_fraction <= 1.0:
            raise ValueError(f"offload_fraction must be in [0, 1], got {self.offload_fraction}")
        if (self.offload_fraction or self.offload_auto) and not self.distributed_optimizer:
            raise ValueError("offload needs the distributed optimizer (the offloaded state is each rank's shard of it)")
        if not self.param_offload_fraction <= self.grad_offload_fraction <= self.offload_fraction:
            raise ValueError("need param_offload_fraction <= grad_offload_fraction <= offload_fraction")
        if self.unsharded_grad_accumulation and not self.shards_grads:
            raise ValueError("unsharded_grad_accumulation needs a strategy that shards gradients")
        if self.grad_offload_fraction and not self.shards_grads:
            raise ValueError("grad_offload_fraction needs a strategy that shards gradients")
        if self.param_offload_fraction and not self.shards_params:
            raise ValueError("param_offload_fraction needs a strategy that shards parameters")
        full = (1.0, float(self.shards_grads), float(self.shards_params))
        if (
            self.offload_auto
            and (self.offload_fraction, self.grad_offload_fraction, self.param_offload_fraction) != full
        ):
            raise ValueError(
                f"offload_auto is estimated as full offload (every movable part on host): fractions must be {full}"
            )
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(f"device_type must be one of {', '.join(DEVICE_TYPES)}, got {self.device_type!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def shards_grads(self) -> bool:
        return self.sharding_strategy in ("optim_grads", "optim_grads_params")

    @property
    def shards_params(self) -> bool:
        return self.sharding_strategy == "optim_grads_params"

    @property
    def reshards_params(self) -> bool:
        """Whether sharded parameters are released between a microbatch's forward and its backward."""
        return self.pp == 1 if self.reshard_after_forward is None else self.reshard_after_forward

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages

    def chunk_position(self, pp_rank: int, chunk: int) -> tuple[bool, bool]:
        """(first stage?, last stage?) of local model chunk `chunk` on pipeline rank `pp_rank`."""
        stage = chunk * self.pp + pp_rank
        return stage == 0, stage == self.stages - 1

    def describe(self) -> str:
        text = f"TP={self.tp} CP={self.cp} PP={self.pp} DP={self.dp}"
        if self.virtual_stages > 1:
            text += f" VPP={self.virtual_stages}"
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            text += f" layers first/last={self.first_stage_layers}/{self.last_stage_layers}"
        if self.sharding_strategy == "optim":
            text += " distributed optimizer"
        elif self.distributed_optimizer:
            text += f" sharded {self.sharding_strategy}"
        if self.offload_auto:
            text += " offload auto (estimated as full offload)"
        elif self.offload_fraction:
            text += f" offload {self.offload_fraction:g}"
            if self.grad_offload_fraction:
                text += f" grads {self.grad_offload_fraction:g}"
            if self.param_offload_fraction:
                text += f" params {self.param_offload_fraction:g}"
        return text + f" micro-batch {self.micro_batch_size} x {self.num_microbatches}"
