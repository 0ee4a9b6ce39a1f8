"""File digests of our checkpoints: CRC-32 recorded from the bytes written and verified; SHA-256 records of
older saves still verify."""

import zlib

import pytest

from megatron.core.checkpointing import CheckpointError, verify_files
from megatron.core.checkpointing.integrity import DIGESTS, DigestingStream


def test_crc32_recorded_while_writing_and_both_digests_verified(tmp_path):
    path = tmp_path / "__0_0.distcp"
    data = bytes(range(256)) * 1000
    with open(path, "wb") as handle:
        stream = DigestingStream(handle)
        for start in range(0, len(data), 777):  # as a writer does: many writes of any size
            stream.write(memoryview(data)[start : start + 777])
        assert stream.tell() == len(data)
    record = stream.record()
    assert record == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert not hasattr(stream, "seek")  # the bytes written, in order, are the file
    old = {"size": record["size"], "sha256": DIGESTS["sha256"](str(path))}
    for expected in (record, old):
        verify_files(str(tmp_path), {path.name: expected})
    corrupt = bytearray(data)
    corrupt[100] ^= 0xFF
    path.write_bytes(bytes(corrupt))
    for expected, kind in ((record, "CRC32"), (old, "SHA256")):
        with pytest.raises(CheckpointError, match=f"{kind} differs from the checkpoint metadata"):
            verify_files(str(tmp_path), {path.name: expected})


def test_an_empty_file_is_recorded_and_verified(tmp_path):
    """DCP writes an empty file for a writer thread that got no items."""
    path = tmp_path / "__0_1.distcp"
    with open(path, "wb") as handle:
        stream = DigestingStream(handle)
    verify_files(str(tmp_path), {path.name: stream.record()})
    path.write_bytes(b"\0")
    with pytest.raises(CheckpointError, match="1 bytes, the checkpoint metadata records 0"):
        verify_files(str(tmp_path), {path.name: stream.record()})
