"""Megatron's indexed dataset: token sequences in `<prefix>.bin`, their index in `<prefix>.idx`.

The .idx layout (little-endian, byte-compatible with Megatron-LM and megatron-core):

    9 bytes  magic b"MMIDIDX\\x00\\x00"
    <Q       version, 1
    <B       dtype code of the tokens in .bin (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
             6 float64, 7 float32, 8 uint16)
    <Q       sequence count S
    <Q       document count D (= number of documents + 1)
    S x int32  sequence lengths (tokens)
    S x int64  byte offset of each sequence in .bin
    D x int64  document indices: sequence index where each document starts, then S

The .bin holds the sequences back to back. The reader memory-maps both files (nothing is
read whole) and checks sizes up front, so a truncated or mismatched pair fails with one
line naming the file rather than with garbage tokens later. The writer writes under
temporary names and renames at the end, .idx last: an interrupted run never leaves an
.idx that looks valid.
"""

from __future__ import annotations

import os
import struct

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
CODES = {np.dtype(t): code for code, t in DTYPES.items()}


def token_dtype(vocab_size: int | None) -> type:
    """Megatron's choice: uint16 tokens when the vocabulary has fewer than 65500 ids, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def write_index(path: str, dtype, sequence_lengths, document_indices) -> None:
    """Write an .idx file (directly to `path`)."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODES[np.dtype(dtype)]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(docs)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(docs.tobytes(order="C"))


class IndexedDatasetWriter:
    """Appends documents to `<prefix>.bin` and writes `<prefix>.idx` on `finalize()`.

    Used as a context manager, an exception removes the temporary files and leaves any
    previous output untouched.
    """

    def __init__(self, prefix: str, dtype):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        if self.dtype not in CODES:
            raise ValueError(f"{prefix}: token dtype {self.dtype} has no Megatron dtype code")
        self._tmp_bin = data_file_path(prefix) + ".tmp"
        self._tmp_idx = index_file_path(prefix) + ".tmp"
        self._bin = open(self._tmp_bin, "wb")  # noqa: SIM115 (open while documents are added; closed by finalize)
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_document(self, tokens, lengths: list[int] | None = None) -> None:
        """One document made of sequences of `lengths` tokens (default: one sequence of all tokens).
        An empty document adds no sequence, as in Megatron."""
        array = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(n for n in ([array.size] if lengths is None else lengths) if n)
        self.document_indices.append(len(self.sequence_lengths))

    def add_documents_bytes(self, data: bytes, document_lengths: list[int]) -> None:
        """Several one-sequence documents of `document_lengths` tokens, encoded back to back in `data`."""
        self._bin.write(data)
        for n in document_lengths:
            if n:
                self.sequence_lengths.append(n)
            self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, prefix: str) -> None:
        """Append a whole indexed dataset of the same dtype (used to merge partitions)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{index_file_path(prefix)}: dtype {other.dtype} differs from {self.dtype}")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.tolist())
        self.document_indices.extend((offset + other.document_indices[1:]).tolist())
        with open(data_file_path(prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)

    def finalize(self) -> None:
        self._bin.close()
        write_index(self._tmp_idx, self.dtype, self.sequence_lengths, self.document_indices)
        if os.path.exists(index_file_path(self.prefix)):
            os.remove(index_file_path(self.prefix))
        os.replace(self._tmp_bin, data_file_path(self.prefix))
        os.replace(self._tmp_idx, index_file_path(self.prefix))

    def abort(self) -> None:
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only, memory-mapped view of `<prefix>.bin/.idx`. Item i is sequence i's tokens."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise ValueError(f"{path}: no such file")
        self.dtype, count, doc_count = self._read_header(idx_path)
        itemsize = self.dtype.itemsize
        expected = HEADER_SIZE + count * (4 + 8) + doc_count * 8
        size = os.path.getsize(idx_path)
        # megatron-core's multimodal datasets append one int8 mode per sequence
        if size < expected:
            raise ValueError(
                f"{idx_path}: truncated: {size} bytes, its header promises {expected} "
                f"({count} sequences, {doc_count - 1} documents)"
            )
        if size not in (expected, expected + count):
            raise ValueError(
                f"{idx_path}: {size} bytes, but its header describes {expected} "
                f"({count} sequences, {doc_count - 1} documents)"
            )
        index = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(index, np.int32, count, HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(index, np.int64, count, HEADER_SIZE + 4 * count)
        self.document_indices = np.frombuffer(index, np.int64, doc_count, HEADER_SIZE + 12 * count)
        if doc_count < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != count:
            raise ValueError(f"{idx_path}: corrupt document indices (must run from 0 to the sequence count {count})")
        data_bytes = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize if count else 0
        bin_size = os.path.getsize(bin_path)
        if bin_size < data_bytes:
            raise ValueError(f"{bin_path}: truncated: {bin_size} bytes, {idx_path} describes {data_bytes}")
        if bin_size != data_bytes:
            raise ValueError(
                f"{bin_path}: {bin_size} bytes, but {idx_path} describes {data_bytes}: "
                f"the two files do not belong together"
            )
        self._data = np.memmap(bin_path, mode="r", dtype=self.dtype) if bin_size else np.zeros(0, self.dtype)

    @staticmethod
    def _read_header(idx_path: str):
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if header[: len(MAGIC)] != MAGIC:
            raise ValueError(
                f"{idx_path}: not a Megatron index file (starts with {header[: len(MAGIC)]!r}, expected {MAGIC!r})"
            )
        if len(header) < HEADER_SIZE:
            raise ValueError(f"{idx_path}: truncated: {len(header)} bytes, shorter than the {HEADER_SIZE}-byte header")
        version, code, count, doc_count = struct.unpack("<QBQQ", header[len(MAGIC) :])
        if version != VERSION:
            raise ValueError(f"{idx_path}: index version {version}, only version {VERSION} is known")
        if code not in DTYPES:
            raise ValueError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPES)})")
        return np.dtype(DTYPES[code]), count, doc_count

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `index` (to its end when length is None)."""
        if length is None:
            length = int(self.sequence_lengths[index]) - offset
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self._data[start : start + length]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    @property
    def num_tokens(self) -> int:
        return len(self._data)
