"""File digests of our checkpoints: CRC-32 written and verified; SHA-256 records of older saves still verify."""

import pytest

from megatron.core.checkpointing import CheckpointError, verify_files
from megatron.core.checkpointing.integrity import DIGESTS, file_digest


def test_crc32_written_and_both_digests_verified(tmp_path):
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(bytes(range(256)) * 1000)
    record = file_digest(str(path))
    assert set(record) == {"size", "crc32"}
    old = {"size": record["size"], "sha256": DIGESTS["sha256"](str(path))}
    for expected in (record, old):
        verify_files(str(tmp_path), {path.name: expected})
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    for expected, kind in ((record, "CRC32"), (old, "SHA256")):
        with pytest.raises(CheckpointError, match=f"{kind} differs from the checkpoint metadata"):
            verify_files(str(tmp_path), {path.name: expected})
