"""The parallel layout of a run: mesh sizes, pipeline split and schedule, the DDP settings.

Built from the command line by megatron/training/config.py `parallel_config_from_args`; read
by the trainer and by the memory estimate and planner (megatron/planning/).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.core.distributed.model_chunk_buffers import DDPConfig
from megatron.core.parallel_state import DEFAULT_ORDER, ParallelDims
from megatron.core.pipeline_parallel.layer_split import stage_layer_ids
from megatron.core.pipeline_parallel.placement import Placement
from megatron.core.pipeline_parallel.schedules import ZERO_BUBBLE


@dataclass
class ParallelConfig:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    virtual_stages: int = 1
    microbatch_group_size: int | None = None
    backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    timeout_minutes: int = 10
    ddp: DDPConfig = field(default_factory=DDPConfig)
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    rank_order: tuple[str, ...] = DEFAULT_ORDER  # fastest first (ParallelDims.order)
    split_backward: bool = False  # pipeline weight gradients after the input gradient is sent
    pipeline_schedule: str = "auto"  # schedules.KINDS: 'auto' picks 1f1b or interleaved by virtual_stages
    heartbeat_timeout: float = 30.0  # seconds of a peer's silence before this rank exits (0: never)
    ep: int = 1  # expert model parallel size
    etp: int | None = None  # expert tensor parallel size (None: tp)

    def __post_init__(self):
        for name in ("tp", "cp", "pp", "dp", "virtual_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.virtual_stages > 1 and self.pp == 1:
            raise ValueError("virtual pipeline stages need a pipeline-parallel size > 1")

    @property
    def splits_backward(self) -> bool:
        """Whether backwards split into input and weight gradients (--split-backward or a zero-bubble schedule)."""
        return self.split_backward or self.pipeline_schedule in ZERO_BUBBLE

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def stages(self) -> int:
        """Pipeline stages: pipeline ranks x virtual stages per rank."""
        return self.pp * self.virtual_stages

    @property
    def placement(self) -> Placement:
        """Where each pipeline stage runs (the V placement under zbv, else the loop)."""
        return Placement.for_schedule(self.pp, self.virtual_stages, self.pipeline_schedule)

    def chunk_position(self, pp_rank: int, chunk: int) -> tuple[bool, bool]:
        """(first stage?, last stage?) of local model chunk `chunk` on pipeline rank `pp_rank`."""
        return self.placement.is_first(pp_rank, chunk), self.placement.is_last(pp_rank, chunk)

    def layer_ids(self, num_layers: int, pp_rank: int) -> list[list[int]]:
        """Global layer indices of each local model chunk of `pp_rank` (layer_split.py)."""
        return stage_layer_ids(
            num_layers,
            self.pp,
            self.virtual_stages,
            pp_rank,
            self.first_stage_layers,
            self.last_stage_layers,
            self.placement.kind,
        )

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(
            tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp, order=self.rank_order, ep=self.ep, etp=self.etp
        )

    def validate_layers(self, num_layers: int) -> None:
        """Every pipeline rank gets a whole number of layers per virtual stage (raises one line)."""
        self.layer_ids(num_layers, 0)
