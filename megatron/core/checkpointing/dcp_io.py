"""Write and read `TensorPiece`s with torch.distributed.checkpoint (DCP).

Every rank writes its own pieces in parallel (two files per rank, by two threads); DCP's global
plan drops replicas (equal name and offsets) and records each tensor's chunks in
`.metadata`. Reading asks DCP for this rank's boxes of the global tensors, so a
checkpoint written by any layout loads into any other (DCP reshards). The
planners only replace how items are listed and found: pieces instead of a
state dict of whole tensors, DTensors or ShardedTensors, because a canonical
piece may be any box (a vocabulary shard cut at the real vocabulary, the two
halves of a SwiGLU shard) and DTensor placements cannot express those.
"""

from __future__ import annotations

import functools
import os

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


def check_pieces_match(pieces: list[TensorPiece], directory: str, process_group=None) -> None:
    """Raise CheckpointError (one line, on every rank alike) when some rank's piece is absent from
    the checkpoint or has another global shape there."""
    problems = [_mismatch(pieces, _read_metadata(directory).state_dict_metadata, directory)]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, problems[0], group=process_group)
        problems = gathered
    problems = [p for p in problems if p is not None]
    if problems:
        raise CheckpointError(problems[0])


def write_pieces(
    pieces: list[TensorPiece],
    directory: str,
    process_group=None,
    objects: dict[str, object] | None = None,
    file_system=None,
) -> None:
    """Write this rank's pieces, and `objects` (name -> a picklable value, DCP's byte items), as a collective over
    `process_group` (or one process without torch.distributed); `file_system`: DCP's `FileSystem` to write
    through (default: its own)."""
    writer = FileSystemWriter(directory, single_file_per_rank=True, thread_count=WRITER_THREADS)
    if file_system is not None:
        writer.fs = file_system
    dcp.save({}, storage_writer=writer, planner=_PieceSavePlanner(pieces, objects or {}), process_group=process_group)


def read_pieces(pieces: list[TensorPiece], directory: str, process_group=None) -> None:
    """Fill each piece's tensor in place from the checkpoint in `directory` (a collective). Every
    piece is checked against the checkpoint's shapes first, on every rank, so a mismatch raises
    CheckpointError before any rank starts the collective."""
    check_pieces_match(pieces, directory, process_group)
    dcp.load({}, storage_reader=_Reader(directory), planner=_PieceLoadPlanner(pieces), process_group=process_group)


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
