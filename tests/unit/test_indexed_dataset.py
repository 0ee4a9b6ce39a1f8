"""The .bin/.idx files match Megatron's MMIDIDX layout byte for byte, and bad files fail in one line."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, token_dtype

DOCS = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]


def golden_index(lengths, dtype_code, itemsize) -> bytes:
    """The .idx Megatron writes, from the format description (one sequence per document)."""
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * itemsize
    header = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", dtype_code)
    header += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(lengths) + 1)
    body = b"".join(struct.pack("<i", n) for n in lengths) + b"".join(struct.pack("<q", p) for p in pointers)
    return header + body + b"".join(struct.pack("<q", i) for i in range(len(lengths) + 1))


def write(prefix, docs=DOCS, dtype=np.uint16):
    with IndexedDatasetWriter(str(prefix), dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    return str(prefix)


@pytest.mark.parametrize("dtype, code, fmt", [(np.uint16, 8, "<H"), (np.int32, 4, "<i")])
def test_writer_matches_golden_bytes(tmp_path, dtype, code, fmt):
    prefix = write(tmp_path / "d", dtype=dtype)
    lengths = [len(d) for d in DOCS]
    assert open(prefix + ".idx", "rb").read() == golden_index(lengths, code, np.dtype(dtype).itemsize)
    assert open(prefix + ".bin", "rb").read() == b"".join(struct.pack(fmt, t) for d in DOCS for t in d)
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]  # no temporary files left


def test_reader_reads_golden_files(tmp_path):
    prefix = str(tmp_path / "g")
    open(prefix + ".idx", "wb").write(golden_index([3, 1, 5], 8, 2))
    open(prefix + ".bin", "wb").write(np.array([t for d in DOCS for t in d], np.uint16).tobytes())
    ds = IndexedDataset(prefix)
    assert len(ds) == 3 and ds.dtype == np.uint16 and ds.num_tokens == 9
    assert [ds[i].tolist() for i in range(3)] == DOCS
    assert ds.get(2, offset=1, length=3).tolist() == [10, 11, 12]
    assert ds.document_indices.tolist() == [0, 1, 2, 3]
    assert isinstance(ds._data, np.memmap)


def test_token_dtype_follows_megatron():
    assert token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32
    assert token_dtype(None) == np.int32


def test_empty_document_adds_no_sequence(tmp_path):
    ds = IndexedDataset(write(tmp_path / "e", [[1, 2], [], [3]]))
    assert len(ds) == 2 and ds.document_indices.tolist() == [0, 1, 1, 2]


def test_merge_appends_datasets(tmp_path):
    a, b = write(tmp_path / "a", DOCS[:2]), write(tmp_path / "b", DOCS[2:])
    with IndexedDatasetWriter(str(tmp_path / "m"), np.uint16) as writer:
        writer.add_index(a)
        writer.add_index(b)
    merged, whole = str(tmp_path / "m"), write(tmp_path / "w")
    for suffix in (".bin", ".idx"):
        assert open(merged + suffix, "rb").read() == open(whole + suffix, "rb").read()


def test_interrupted_write_leaves_no_output(tmp_path):
    with pytest.raises(RuntimeError), IndexedDatasetWriter(str(tmp_path / "x"), np.uint16) as writer:
        writer.add_document([1, 2, 3])
        raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def corrupt(prefix, path_suffix, edit):
    path = prefix + path_suffix
    data = bytearray(open(path, "rb").read())
    open(path, "wb").write(bytes(edit(data)))


BAD_FILES = [
    ("wrong magic", ".idx", lambda d: b"NOTMEGA!!" + d[9:], "not a Megatron index file"),
    ("short header", ".idx", lambda d: d[:20], "shorter than the 34-byte header"),
    ("truncated idx", ".idx", lambda d: d[:-8], "truncated"),
    ("bad version", ".idx", lambda d: d[:9] + struct.pack("<Q", 2) + d[17:], "index version 2"),
    ("bad dtype", ".idx", lambda d: d[:17] + b"\x09" + d[18:], "unknown dtype code 9"),
    ("truncated bin", ".bin", lambda d: d[:-2], "truncated: 16 bytes"),
    ("bin too long", ".bin", lambda d: d + b"\x00\x00", "do not belong together"),
]


@pytest.mark.parametrize("name, suffix, edit, message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_files_fail_in_one_line(tmp_path, name, suffix, edit, message):
    prefix = write(tmp_path / "c")
    corrupt(prefix, suffix, edit)
    with pytest.raises(ValueError, match=message) as info:
        IndexedDataset(prefix)
    assert prefix + suffix in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("missing", [".bin", ".idx"])
def test_missing_file(tmp_path, missing):
    prefix = write(tmp_path / "m")
    os.remove(prefix + missing)
    with pytest.raises(ValueError, match=f"{prefix}{missing}: no such file"):
        IndexedDataset(prefix)
