"""The process mesh: one object holding the tp, cp, dp and pp process groups.

Built once from a `torch.distributed.device_mesh.DeviceMesh` with dimension order
(pp, dp, cp, tp) so tp varies fastest (tp ranks are neighbours and stay inside a
node). Everything that communicates receives this object, or one of its groups,
explicitly; there are no module-level process groups.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the four parallel dimensions; validated against the world size."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, cp: int = 1, pp: int = 1) -> "ParallelDims":
        """Infer dp from the world size, as Megatron does; refuse sizes that do not divide."""
        for name, size in (("--tensor-model-parallel-size", tp), ("--context-parallel-size", cp),
                           ("--pipeline-model-parallel-size", pp)):
            if size < 1:
                raise ValueError(f"{name} must be >= 1, got {size}")
        model_parallel = tp * cp * pp
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor ({tp}) x context ({cp}) x "
                f"pipeline ({pp}) parallel sizes = {model_parallel}; launch a multiple of {model_parallel} ranks"
            )
        return cls(tp=tp, cp=cp, dp=world_size // model_parallel, pp=pp)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank (tp fastest, then cp, dp, pp)."""
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return {"tp": tp_rank, "cp": cp_rank, "dp": dp_rank, "pp": pp_rank}

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def describe(self) -> str:
        return f"TP={self.tp} CP={self.cp} DP={self.dp} PP={self.pp} (world size {self.world_size})"


class ParallelMesh:
    """Process groups of one rank: tp, cp, dp, pp and the combined dp x cp group.

    `dp_cp_group` is the group over which gradients are averaged and optimizer
    state is sharded: ranks holding the same model shard.
    """

    def __init__(self, dims: ParallelDims, device_type: str):
        world = dist.get_world_size()
        if dims.world_size != world:
            raise ValueError(f"parallel sizes {dims.describe()} do not match the launched world size {world}")
        self.dims = dims
        self.rank = dist.get_rank()
        self.device_mesh: DeviceMesh = init_device_mesh(
            device_type, (dims.pp, dims.dp, dims.cp, dims.tp), mesh_dim_names=MESH_DIMS
        )
        self.tp_group = self.device_mesh.get_group("tp")
        self.cp_group = self.device_mesh.get_group("cp")
        self.dp_group = self.device_mesh.get_group("dp")
        self.pp_group = self.device_mesh.get_group("pp")
        self.dp_cp_group = self._dp_cp_group()
        coords = dims.coords(self.rank)
        self.tp_rank, self.cp_rank = coords["tp"], coords["cp"]
        self.dp_rank, self.pp_rank = coords["dp"], coords["pp"]
        self.pp_ranks = [dims.rank_of(self.tp_rank, self.cp_rank, self.dp_rank, p) for p in range(dims.pp)]
        self.embedding_group = self._embedding_group()

    def _dp_cp_group(self):
        """Ranks that hold the same model shard (same tp and pp rank): gradients are averaged and
        optimizer state sharded over them. Built with public API (DeviceMesh can only flatten
        dimensions through a private method)."""
        mesh = self.device_mesh.mesh  # [pp, dp, cp, tp]
        ranks = mesh.permute(0, 3, 1, 2).reshape(self.dims.pp * self.dims.tp, -1).tolist()
        group, _ = dist.new_subgroups_by_enumeration(ranks)
        return group

    def _embedding_group(self):
        """First and last pipeline stage of this rank's pipeline: they hold the two copies of
        tied embeddings. Every rank takes part in creating every group, as torch requires."""
        if self.dims.pp == 1:
            return None
        mine = None
        for pp_ranks in self.device_mesh.mesh.reshape(self.dims.pp, -1).t().tolist():
            group = dist.new_group([pp_ranks[0], pp_ranks[-1]])
            if self.rank in (pp_ranks[0], pp_ranks[-1]):
                mine = group
        return mine

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def pp_size(self) -> int:
        return self.dims.pp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    def pp_peer(self, offset: int) -> int:
        """Global rank of the pipeline neighbour `offset` stages away (wrapping, for interleaving)."""
        return self.pp_ranks[(self.pp_rank + offset) % self.dims.pp]
