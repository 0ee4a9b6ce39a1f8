"""Layout-independent checkpoints: canonical tensor pieces written and read with
torch.distributed.checkpoint, plus per-file integrity records."""

from megatron.core.checkpointing.dcp_io import (
    CheckpointError,
    every_rank,
    read_pieces,
    saved_tensors,
    write_pieces,
)
from megatron.core.checkpointing.integrity import RECORD, gather_digests, verify_files, write_pieces_with_digests
from megatron.core.checkpointing.optimizer_state import MOMENTS, optimizer_state_pieces, state_name
from megatron.core.checkpointing.pieces import TensorPiece, model_pieces, parameter_pieces

__all__ = [
    "MOMENTS",
    "RECORD",
    "CheckpointError",
    "TensorPiece",
    "every_rank",
    "gather_digests",
    "model_pieces",
    "optimizer_state_pieces",
    "parameter_pieces",
    "read_pieces",
    "saved_tensors",
    "state_name",
    "verify_files",
    "write_pieces",
    "write_pieces_with_digests",
]
