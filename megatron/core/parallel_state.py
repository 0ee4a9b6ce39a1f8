"""The process mesh: one object holding the tp, cp, dp and pp process groups.

Ranks are numbered by a rank order, fastest-varying dimension first, as Megatron's
RankGenerator order strings are: the default "tp-cp-dp-pp" keeps tp ranks neighbours
(inside a node) and pipeline stages furthest apart; `--use-tp-pp-dp-mapping` swaps
the last two ("tp-cp-pp-dp", dp slowest). `ParallelDims` is the one definition of
that numbering (coords, rank_of); `ParallelMesh` builds a
`torch.distributed.device_mesh.DeviceMesh` whose dimensions are the order reversed
(slowest first: row-major rank = rank_of) and derives every group from it.
Everything that communicates receives this object, or one of its groups,
explicitly; there are no module-level process groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DEFAULT_ORDER = ("tp", "cp", "dp", "pp")  # Megatron's "tp-cp-ep-dp-pp" (ep is 1 here)
TP_PP_DP_ORDER = ("tp", "cp", "pp", "dp")  # --use-tp-pp-dp-mapping: Megatron's "tp-cp-ep-pp-dp"


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the four parallel dimensions and the rank order (fastest first); validated
    against the world size."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    order: tuple[str, ...] = DEFAULT_ORDER
    ep: int = 1  # expert parallel: carved out of tp x cp x dp with etp, as Megatron folds it
    etp: int | None = None  # expert tensor parallel (None: tp)

    def __post_init__(self):
        if sorted(self.order) != sorted(DEFAULT_ORDER):
            raise ValueError(f"rank order must name tp, cp, dp and pp once each, got {'-'.join(self.order)}")
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for flag, size in (("--expert-model-parallel-size", self.ep), ("--expert-tensor-parallel-size", self.etp)):
            if size < 1:
                raise ValueError(f"{flag} must be >= 1, got {size}")
        stage = self.tp * self.cp * self.dp
        if stage % (self.etp * self.ep):
            raise ValueError(
                f"--expert-tensor-parallel-size ({self.etp}) x --expert-model-parallel-size ({self.ep}) = "
                f"{self.etp * self.ep} must divide tp x cp x dp = {self.tp} x {self.cp} x {self.dp} = {stage} "
                "(experts are spread over the ranks of one pipeline stage)"
            )

    @classmethod
    def from_world(
        cls,
        world_size: int,
        tp: int = 1,
        cp: int = 1,
        pp: int = 1,
        order: tuple[str, ...] = DEFAULT_ORDER,
        ep: int = 1,
        etp: int | None = None,
    ) -> ParallelDims:
        """Infer dp from the world size, as Megatron does; refuse sizes that do not divide."""
        for name, size in (
            ("--tensor-model-parallel-size", tp),
            ("--context-parallel-size", cp),
            ("--pipeline-model-parallel-size", pp),
        ):
            if size < 1:
                raise ValueError(f"{name} must be >= 1, got {size}")
        model_parallel = tp * cp * pp
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
                f"--context-parallel-size ({cp}) x --pipeline-model-parallel-size ({pp}) = {model_parallel}; "
                f"launch a multiple of {model_parallel} ranks"
            )
        return cls(tp=tp, cp=cp, dp=world_size // model_parallel, pp=pp, order=order, ep=ep, etp=etp)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def size(self, name: str) -> int:
        return getattr(self, name)

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """DeviceMesh dimension names, slowest first, so that a rank's row-major index is its rank."""
        return tuple(reversed(self.order))

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank (the first dimension of `order` varies fastest)."""
        coords = {}
        for name in self.order:
            rank, coords[name] = divmod(rank, self.size(name))
        return coords

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at these coordinates: the inverse of `coords`."""
        coords, rank = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}, 0
        for name in self.mesh_dims:
            rank = rank * self.size(name) + coords[name]
        return rank

    @property
    def edp(self) -> int:
        """Expert data parallel: the replicas of each expert shard within a pipeline stage."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    def expert_coords(self, rank: int) -> dict[str, int]:
        """(etp, ep, edp, pp) of a rank. Megatron numbers expert ranks tp-ep-dp-pp (or tp-ep-pp-dp): within a
        pipeline stage, the rank's place in tp, cp, dp order (tp fastest) is read again as etp, ep, edp."""
        c = self.coords(rank)
        local = c["tp"] + self.tp * (c["cp"] + self.cp * c["dp"])
        return {
            "etp": local % self.etp,
            "ep": local // self.etp % self.ep,
            "edp": local // (self.etp * self.ep),
            "pp": c["pp"],
        }

    def describe(self) -> str:
        experts = f" EP={self.ep} ETP={self.etp} EDP={self.edp}" if self.ep > 1 or self.etp != self.tp else ""
        return (
            f"TP={self.tp} CP={self.cp} DP={self.dp} PP={self.pp}{experts} (world size {self.world_size}, "
            f"rank order {'-'.join(self.order)})"
        )


@dataclass(frozen=True)
class ExpertGroups:
    """The process groups an MoE layer uses (None: a group of one rank). `ep`: expert parallel (the experts are
    split over it); `etp`: expert tensor parallel (each expert's weights are split over it); `tp_ep`: both
    (the allgather dispatcher's group); `tp_cp`: the ranks whose tokens make up the same sequences (the
    load-balancing loss counts routes over them)."""

    ep: object = None
    etp: object = None
    tp_ep: object = None
    tp_cp: object = None

    @staticmethod
    def _size_rank(group) -> tuple[int, int]:
        return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))

    @property
    def ep_size_rank(self) -> tuple[int, int]:
        return self._size_rank(self.ep)

    @property
    def etp_size_rank(self) -> tuple[int, int]:
        return self._size_rank(self.etp)


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
            device_type, tuple(dims.size(name) for name in dims.mesh_dims), mesh_dim_names=dims.mesh_dims
        )
        self.tp_group = self.device_mesh.get_group("tp")
        self.cp_group = self.device_mesh.get_group("cp")
        self.dp_group = self.device_mesh.get_group("dp")
        self.pp_group = self.device_mesh.get_group("pp")
        self.dp_cp_group = self._dp_cp_group()
        self.tp_cp_group = self._enumerated("dp", "pp", "tp", "cp", rows=dims.dp * dims.pp)
        self.stage_group = self._enumerated("pp", "tp", "dp", "cp", rows=dims.pp)  # tp x dp x cp of one stage
        self.ep_group = self._expert_group("pp", "etp", "edp")
        self.etp_group = self._expert_group("pp", "ep", "edp")
        self.tp_ep_group = self._expert_group("pp", "edp")
        self.edp_group = self._expert_group("pp", "etp", "ep")  # expert weights' gradients and optimizer shards
        coords = dims.coords(self.rank)
        self.tp_rank, self.cp_rank = coords["tp"], coords["cp"]
        self.dp_rank, self.pp_rank = coords["dp"], coords["pp"]
        self.pp_ranks = [dims.rank_of(**{**coords, "pp": p}) for p in range(dims.pp)]
        self.embedding_group = self._embedding_group()

    def _dp_cp_group(self):
        """Ranks that hold the same model shard (same tp and pp rank): gradients are averaged and
        optimizer state sharded over them. Built with public API (DeviceMesh can only flatten
        dimensions through a private method)."""
        ranks = self._mesh_as("tp", "pp", "dp", "cp").reshape(self.dims.tp * self.dims.pp, -1).tolist()
        group, _ = dist.new_subgroups_by_enumeration(ranks)
        return group

    def _enumerated(self, *names: str, rows: int):
        """This rank's group among the rows of the mesh laid out as `names` and cut into `rows` groups."""
        group, _ = dist.new_subgroups_by_enumeration(self._mesh_as(*names).reshape(rows, -1).tolist())
        return group

    def _expert_group(self, *fixed: str):
        """This rank's group of the ranks that share its expert coordinates `fixed` (ordered by rank: etp fastest)."""
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.dims.world_size):
            coords = self.dims.expert_coords(rank)
            groups.setdefault(tuple(coords[name] for name in fixed), []).append(rank)
        group, _ = dist.new_subgroups_by_enumeration(list(groups.values()))
        return group

    @property
    def expert_groups(self) -> ExpertGroups:
        return ExpertGroups(ep=self.ep_group, etp=self.etp_group, tp_ep=self.tp_ep_group, tp_cp=self.tp_cp_group)

    def _embedding_group(self):
        """First and last pipeline stage of this rank's pipeline: they hold the two copies of
        tied embeddings. Every rank takes part in creating every group, as torch requires."""
        if self.dims.pp == 1:
            return None
        mine = None
        for pp_ranks in self._mesh_as("tp", "cp", "dp", "pp").reshape(-1, self.dims.pp).tolist():
            group = dist.new_group([pp_ranks[0], pp_ranks[-1]])
            if self.rank in (pp_ranks[0], pp_ranks[-1]):
                mine = group
        return mine

    def _mesh_as(self, *names: str):
        """The mesh's rank tensor with its dimensions permuted to `names`, whatever the rank order."""
        return self.device_mesh.mesh.permute(*(self.dims.mesh_dims.index(n) for n in names))

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
