"""Size and CRC-32 of each checkpoint file: recorded at save, verified before a load.

DCP itself notices a missing file only when a rank reads from it, mid-load, and
never notices a truncated or altered file. A save digests each file from the bytes
as they are written (`DigestingStream`: no second pass over the files), and the
ranks share their files' digests. A load's ranks verify disjoint subsets of the
files in parallel (file i on rank i mod world), then share the results.

The digest guards against accidents (a truncated copy, a flipped bit, a file of
another save), not against tampering, so it is a CRC-32 (zlib's checksum, computed
by ISA-L's carry-less multiplication where the `isal` package is installed: 3x
zlib's speed here; zlib's own otherwise), not SHA-256 (5-6x slower than zlib's
CRC-32 here; tools/bench/checkpoint.py measures the whole save and load).
Checkpoints written with SHA-256 digests still verify.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem

from megatron.core.checkpointing.dcp_io import CheckpointError, any_rank, write_pieces
from megatron.core.checkpointing.pieces import TensorPiece

try:  # the same CRC-32 as zlib.crc32 (a setup.py requirement; environments installed before it have zlib's)
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32

_BLOCK = 1 << 24
RECORD = "metadata.json"  # the file that holds the digests of all the others


def _crc32(path: str) -> str:
    """Over a read-only map of the file: the CRC reads the page cache in place, no copy into a buffer
    (a file truncated by another process during the check would end this one with SIGBUS)."""
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:  # mmap refuses an empty file
            return "00000000"
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
            view.madvise(mmap.MADV_SEQUENTIAL)  # read ahead from disk as read() would
            return f"{crc32(view):08x}"


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


DIGESTS = {"crc32": _crc32, "sha256": _sha256}  # the first is written; any is verified


class DigestingStream:
    """A file being written: forwards each write and keeps the size and CRC-32 of the bytes written,
    its record ({'size': bytes, 'crc32': hex digest}) without reading the file back. It has no `seek`
    (a writer that needs one fails), so the bytes written, in order, are the file's content."""

    def __init__(self, stream):
        self.stream, self.size, self.crc = stream, 0, 0

    def write(self, data) -> int:
        self.crc = crc32(data, self.crc)
        self.size += memoryview(data).nbytes
        return self.stream.write(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def close(self) -> None:
        """Flushes only: the file is closed by the `_DigestingFileSystem.create_stream` that opened it. DCP
        closes the stream after each item it writes into it (`_DirectWrites`)."""
        self.stream.flush()

    def record(self) -> dict:
        return {"size": self.size, "crc32": f"{self.crc:08x}"}


class _DirectWrites:
    """DCP's stream transforms (none are used) without their wrapper around the file: DCP writes each item
    through a class it defines anew, whose every write is one more Python call (a torch.save makes ~40
    per tensor), and whose close, after each item, flushes. A `DigestingStream` is closed by its file
    system, not by DCP's close."""

    def transform_save_stream(self, write_item, raw_stream):
        return raw_stream, []


class _DigestingFileSystem(FileSystem):
    """DCP's local file system, keeping the record of every file written through it."""

    def __init__(self):
        super().__init__()
        self.digests: dict[str, dict] = {}  # file name -> record (set by DCP's writer threads)

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            digesting = DigestingStream(stream)
            yield digesting
        self.digests[Path(path).name] = digesting.record()

    def rename(self, path, new_path) -> None:  # DCP writes `.metadata` under a temporary name
        super().rename(path, new_path)
        self.digests[Path(new_path).name] = self.digests.pop(Path(path).name)


def write_pieces_with_digests(pieces: list[TensorPiece], directory: str, process_group=None) -> dict[str, dict]:
    """`write_pieces`, returning the record of each file, from the bytes written: on rank 0 every rank's
    files and `.metadata` (the records travel with DCP's write results), elsewhere this rank's own. A
    collective over `process_group` (a background writer's group of its own)."""
    file_system = _DigestingFileSystem()
    # DCP torch.saves each item: a zip record with a CRC-32 of its own, which torch.load never checks.
    # The file's CRC-32 covers those bytes, so torch's second pass over the data is left out (a global
    # setting while the write lasts: a torch.save elsewhere meanwhile writes records without it, which
    # torch.load reads all the same).
    computed = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        reports = write_pieces(
            pieces,
            directory,
            process_group,
            file_system=file_system,
            transforms=_DirectWrites(),
            report=lambda: dict(file_system.digests),
        )
    finally:
        torch.serialization.set_crc32_options(computed)
    # rank 0's own records last: they hold `.metadata`, written after the reports were sent
    return {name: record for share in (reports or []) + [file_system.digests] for name, record in share.items()}


def _my_share(names: list[str]) -> list[str]:
    if not dist.is_initialized():
        return names
    return names[dist.get_rank() :: dist.get_world_size()]


def gather_digests(local: dict) -> dict:
    """Every rank's {file: record} (or {file: problem}) merged, on every rank (a collective)."""
    if not dist.is_initialized():
        return local
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {key: value for part in parts for key, value in part.items()}


def _problem(directory: str, name: str, expected: dict) -> str | None:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return f"{path}: shard file missing"
    size = os.path.getsize(path)
    if size != expected["size"]:
        return f"{path}: {size} bytes, the checkpoint metadata records {expected['size']} (truncated or altered)"
    kind = next(k for k in DIGESTS if k in expected)
    if DIGESTS[kind](path) != expected[kind]:
        return f"{path}: {kind.upper()} differs from the checkpoint metadata (corrupt)"
    return None


def verify_files(directory: str, expected: dict[str, dict]) -> None:
    """Raise CheckpointError (one line, the same on every rank) unless every file matches its
    recorded size and digest, and every file DCP reads (`*.distcp`, `.metadata`) has one: a shard
    that no digest covers was never verified."""
    local = {name: _problem(directory, name, expected[name]) for name in _my_share(sorted(expected))}
    unrecorded = sorted(
        name
        for name in os.listdir(directory)
        if (name.endswith(".distcp") or name == ".metadata") and name not in expected
    )
    # the problems are gathered only when some rank found one (one small all-reduce otherwise)
    failed = any_rank(any(p is not None for p in local.values()))
    problems = sorted(
        ([p for p in gather_digests(local).values() if p is not None] if failed else [])
        + [
            f"{os.path.join(directory, name)}: not in the checkpoint's record of files and digests "
            "(written by a rank whose digests were lost?)"
            for name in unrecorded
        ]
    )
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + more)
