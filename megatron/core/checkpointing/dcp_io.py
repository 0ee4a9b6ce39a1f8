"""Write and read `TensorPiece`s with torch.distributed.checkpoint (DCP).

Every rank writes its own pieces in parallel (two files per rank, by two threads); DCP's global
plan drops replicas (equal name and offsets) and records each tensor's chunks in
`.metadata`. Reading asks DCP for this rank's boxes of the global tensors, so a
checkpoint written by any layout loads into any other (DCP reshards). The
planners only replace how items are listed and found: pieces instead of a
state dict of whole tensors, DTensors or ShardedTensors, because a canonical
piece may be any box (a vocabulary shard cut at the real vocabulary, the two
halves of a SwiGLU shard) and DTensor placements cannot express those.

DCP's own save and load make four object collectives each (gather, scatter, gather, broadcast of
pickled plans and results; ~9 ms apiece at 4 gloo ranks on 2 cores, against ~1 ms for a small
all-reduce). Here a save exchanges the plans only when they changed (`_global_plan`), gathers the
results to rank 0 once, and agrees on failures with one all-reduce (`agree`); a read needs no
collective of DCP's at all (`read_pieces`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron.core.checkpointing.pieces import TensorPiece
from megatron.core.errors import AgreedError

DCP_METADATA = ".metadata"
WRITER_THREADS = 2  # files per rank written in parallel (megatron-core's default too)


class CheckpointError(AgreedError):
    """A checkpoint that cannot be used; the message is one line naming the path, the same on every
    rank (checks that read files share their findings before raising)."""


def _index(piece: TensorPiece) -> MetadataIndex:
    return MetadataIndex(piece.name, torch.Size(piece.offsets))


def _key(index: MetadataIndex) -> tuple:
    return index.fqn, tuple(index.offset)


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous `tensor` as a tensor whose storage is its own bytes (shared, not copied). DCP's writer
    clones a tensor that is a view of a larger storage (a parameter in a flat buffer, an optimizer state
    range), so that torch.save does not write all of that storage: a copy of the whole state."""
    size = tensor.numel() * tensor.element_size()
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() == size:
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    storage = tensor.untyped_storage()[start : start + size]  # keeps the larger storage alive
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(storage, 0, tensor.shape, tensor.stride())


class _PieceSavePlanner(DefaultSavePlanner):
    def __init__(self, pieces: list[TensorPiece], objects: dict[str, object]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {_key(_index(p)): p for p in pieces}
        self.objects = objects

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=_index(p),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(p.offsets), torch.Size(p.sizes)),
                    properties=TensorProperties(dtype=p.dtype),
                    size=torch.Size(p.global_shape),
                ),
            )
            for p in self.pieces.values()
        ]
        items += [WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO) for name in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self.objects:
            return self.objects[index.fqn]  # DCP pickles it (torch.save)
        return _own_storage(self.pieces[_key(index)].tensor())


class _PieceLoadPlanner(DefaultLoadPlanner):
    def __init__(self, pieces: list[TensorPiece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.piece_list = pieces
        self.pieces = {_key(_index(p)): p for p in pieces}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests = []
        for piece in self.piece_list:
            chunk = ChunkStorageMetadata(torch.Size(piece.offsets), torch.Size(piece.sizes))
            requests += create_read_items_for_chunk_list(
                piece.name, self.metadata.state_dict_metadata[piece.name], [chunk]
            )
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[_key(index)].tensor()


def _mismatch(pieces: list[TensorPiece], saved: dict, directory: str) -> str | None:
    """Why the pieces cannot be read from a checkpoint with tensors `saved` (None: they can)."""
    for piece in pieces:
        entry = saved.get(piece.name)
        if not isinstance(entry, TensorStorageMetadata):
            return f"{directory}: the checkpoint has no tensor {piece.name} (the model flags ask for it)"
        if tuple(entry.size) != tuple(piece.global_shape):
            return (
                f"{directory}: {piece.name} has shape {tuple(entry.size)} in the checkpoint, "
                f"the model flags give {tuple(piece.global_shape)}"
            )
    return None


def _flag_device(process_group) -> torch.device:
    """Where a collective of `process_group` takes its tensors (NCCL: this rank's GPU)."""
    if dist.get_backend(process_group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def every_rank(flags: list[bool], process_group=None) -> list[bool]:
    """Which of `flags` (as many on every rank) are true on every rank (a collective: one small
    all-reduce; `flags` themselves without torch.distributed)."""
    if not dist.is_initialized():
        return list(flags)
    values = torch.tensor([int(f) for f in flags] or [1], device=_flag_device(process_group))
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=process_group)
    return [bool(v) for v in values.tolist()[: len(flags)]]


def any_rank(flag: bool, process_group=None) -> bool:
    """Whether `flag` is true on some rank (a collective: one small all-reduce)."""
    return not every_rank([not flag], process_group)[0]


def agree(problem: str | None, process_group=None) -> None:
    """Raise CheckpointError on every rank alike (the lowest rank's problem) when some rank has a problem
    (a collective). When no rank has one, as in every good save and load, that costs one small
    all-reduce, not an object all-gather (several times its time: 9 ms vs 1 ms at 4 gloo ranks on 2
    cores); the problems are gathered only when there is one."""
    if any_rank(problem is not None, process_group) and dist.is_initialized():
        gathered = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, problem, group=process_group)
        problem = next(p for p in gathered if p is not None)
    if problem is not None:
        raise CheckpointError(problem)


def check_pieces_match(pieces: list[TensorPiece], directory: str, process_group=None) -> None:
    """Raise CheckpointError (one line, on every rank alike) when some rank's piece is absent from
    the checkpoint or has another global shape there."""
    agree(_mismatch(pieces, _read_metadata(directory).state_dict_metadata, directory), process_group)


def write_pieces(
    pieces: list[TensorPiece],
    directory: str,
    process_group=None,
    objects: dict[str, object] | None = None,
    file_system=None,
    transforms=None,
    report=None,
) -> list | None:
    """Write this rank's pieces, and `objects` (name -> a picklable value, DCP's byte items), as a collective over
    `process_group` (or one process without torch.distributed); `file_system`: DCP's `FileSystem` to write
    through (default: its own), `transforms`: its writer's stream transforms (default: its own). `report()`:
    what each rank tells rank 0 once it has written its files (sent with DCP's results); rank 0 returns
    every rank's, by rank (others: None)."""
    writer = FileSystemWriter(directory, single_file_per_rank=True, thread_count=WRITER_THREADS)
    if file_system is not None:
        writer.fs = file_system
    if transforms is not None:
        writer.transforms = transforms
    planner = _PieceSavePlanner(pieces, objects or {})
    if not dist.is_initialized():
        dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
        return [report() if report is not None else None]
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    planner.set_up_planner({}, writer.storage_meta(), rank == 0)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    local, problem = None, None
    try:
        local = writer.prepare_local_plan(planner.create_local_plan())
    except Exception as error:  # noqa: BLE001 - shared with every rank below
        problem = f"{directory}: planning the save failed on rank {dist.get_rank()} ({type(error).__name__}: {error})"
    agree(problem, process_group)
    plan, metadata = _global_plan(planner, writer, local, rank, world, process_group)
    written = None  # (DCP's write results, the report)
    try:
        written = (
            writer.write_data(planner.finish_plan(plan), planner).value(),
            report() if report is not None else None,
        )
    except Exception as error:  # noqa: BLE001 - shared with every rank below
        problem = f"{directory}: writing failed on rank {dist.get_rank()} ({type(error).__name__}: {error})"
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(
        written, gathered, dst=dist.get_global_rank(process_group, 0) if process_group else 0, group=process_group
    )
    if rank == 0 and problem is None and all(w is not None for w in gathered):
        try:  # `.metadata`: every tensor's chunks and where they are
            writer.finish(metadata, [results for results, _ in gathered])
        except Exception as error:  # noqa: BLE001 - shared with every rank below
            problem = f"{directory}: writing {DCP_METADATA} failed ({type(error).__name__}: {error})"
    agree(problem, process_group)  # a rank that failed to write left rank 0 without its results
    return [reported for _, reported in gathered] if rank == 0 else None


# (exchange, this rank's part of a global plan, rank 0's metadata) by (process group's ranks, rank, local
# plan): a save of the same pieces as an earlier one (every save of a training run) needs no exchange of
# plans. `exchange` names the set of every rank's local plans the global plan was made from.
_PLANS: dict[tuple, tuple[int, SavePlan, object]] = {}
_PLANS_KEPT = 8


def _signature(plan: SavePlan) -> tuple:
    """What of a local plan the global plan depends on (deterministic: its repr is the same in every process)."""
    return tuple(
        (item.index.fqn, tuple(item.index.offset or ()), item.type.name)
        + (
            (tuple(item.tensor_data.size), tuple(item.tensor_data.chunk.sizes), str(item.tensor_data.properties.dtype))
            if item.tensor_data is not None
            else ()
        )
        for item in plan.items
    )


def _same_exchange(exchange: int | None, process_group) -> bool:
    """Whether every rank found a global plan made by the same exchange (a collective: one small all-reduce)."""
    hit = exchange is not None
    values = torch.tensor([int(hit), exchange or 0, -(exchange or 0)], device=_flag_device(process_group))
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=process_group)
    return bool(values[0]) and values[1].item() == -values[2].item()


def _global_plan(planner, writer, local: SavePlan, rank: int, world: int, process_group) -> tuple[SavePlan, object]:
    """This rank's part of DCP's global plan (replicas written once, by the rank DCP's deduplication picks)
    and, on rank 0, the checkpoint's metadata (a collective). When every rank's local plan is one it had
    in the same earlier exchange (one small all-reduce says so), every rank's plan is that exchange's, and
    so is the global plan: the plans are not exchanged again (an object all-gather, several times the
    time of the all-reduce at 4 ranks on 2 cores)."""
    key = (tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD)), rank, _signature(local))
    cached = _PLANS.get(key)
    if _same_exchange(cached[0] if cached else None, process_group):
        return cached[1], cached[2]
    plans = [None] * world
    dist.all_gather_object(plans, local, group=process_group)
    global_plans, metadata = planner.create_global_plan(plans)  # deterministic: every rank computes it
    plan = writer.prepare_global_plan(global_plans)[rank]
    digest = hashlib.sha256(repr([_signature(p) for p in plans]).encode()).digest()
    _PLANS[key] = (int.from_bytes(digest[:7], "little") + 1, plan, metadata if rank == 0 else None)
    while len(_PLANS) > _PLANS_KEPT:
        del _PLANS[next(iter(_PLANS))]
    return plan, metadata


def read_pieces(pieces: list[TensorPiece], directory: str, process_group=None) -> None:
    """Fill each piece's tensor in place from the checkpoint in `directory` (a collective). Every
    piece is checked against the checkpoint's shapes first, on every rank, so a mismatch raises
    CheckpointError before any rank reads. Each rank then reads its own boxes, knowing every file
    from the global `.metadata`: DCP's load without its collectives (a gather and a scatter of the
    plans, which a read does not need, and an all-gather), which cost more than the reading at 4 ranks
    on 2 cores. A rank whose read fails raises CheckpointError on every rank alike. A box this rank
    holds twice (both copies of a tied embedding on one rank, zbv's rank 0) is read once and copied."""
    check_pieces_match(pieces, directory, process_group)
    first: dict[tuple, TensorPiece] = {}  # the box -> the piece read into
    again: list[tuple[TensorPiece, TensorPiece]] = []  # (piece read, piece copied from it)
    for piece in pieces:
        key = _key(_index(piece))
        if key in first:
            again.append((first[key], piece))
        else:
            first[key] = piece
    problem = None
    try:
        with warnings.catch_warnings():  # DCP warns that no_dist means one process: here, one rank's reads
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            planner = _PieceLoadPlanner(list(first.values()))
            dcp.load({}, storage_reader=_Reader(directory), planner=planner, no_dist=True)
        for original, copy in again:
            copy.tensor().copy_(original.tensor())
    except Exception as error:  # noqa: BLE001 - shared with every rank below
        if not dist.is_initialized():
            raise
        problem = f"{directory}: reading failed on rank {dist.get_rank()} ({type(error).__name__}: {error})"
    agree(problem, process_group)


def saved_tensors(directory: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (global shape, dtype) of every tensor in the checkpoint, read from its `.metadata`."""
    metadata = _read_metadata(directory)
    return {
        name: (tuple(entry.size), entry.properties.dtype)
        for name, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }


def _read_metadata(directory: str):
    """The checkpoint's `.metadata`, parsed once while the file stays the same one: a load reads it for
    the vocabulary rows, the shape checks and each DCP read."""
    try:
        stat = os.stat(os.path.join(directory, DCP_METADATA))
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no {DCP_METADATA} file (not a complete torch_dist checkpoint)") from None
    return _parsed_metadata(os.path.abspath(directory), (stat.st_ino, stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=1)
def _parsed_metadata(directory: str, identity: tuple[int, int, int]):
    return FileSystemReader(directory).read_metadata()


class _Reader(FileSystemReader):
    """DCP's reader, with the `.metadata` as parsed once (`_read_metadata`)."""

    def read_metadata(self, *args, **kwargs):
        return _read_metadata(str(self.path))
