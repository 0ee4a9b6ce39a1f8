"""Vocabulary tensors across padded sizes.

Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x tp and trains the
padding rows like the others; a checkpoint (ours or Megatron-LM's) keeps them, so its vocabulary
tensors (`embedding.word_embeddings.weight`, `output_layer.weight`, and their optimizer state)
have the rows the saving layout padded to. A layout that pads to another size reads the rows both
have: rows it has beyond the checkpoint's keep their initial values (drawn as Megatron draws
padding: `initialization.py`), rows of the checkpoint beyond its own are dropped; either way one
note line names the rows (`rows_note`).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.core.checkpointing.pieces import TensorPiece
from megatron.core.tensor_parallel.initialization import InitSpec, initialize_

VOCABULARY = ("embedding.word_embeddings.weight", "output_layer.weight")


def is_vocabulary(name: str) -> bool:
    """A vocabulary tensor's name, ours or Megatron-LM's, model or optimizer state."""
    return any(name == v or name.endswith("." + v) for v in VOCABULARY)


def saved_vocab_rows(tensors: dict) -> int | None:
    """The rows of the vocabulary tensors among `tensors` (name -> (shape, dtype), as
    `saved_tensors` gives them); None without any."""
    rows = [tensors[name][0][0] for name in VOCABULARY if name in tensors]
    return rows[0] if rows else None


def fit_rows(pieces: list[TensorPiece], rows: int | None) -> list[TensorPiece]:
    """`pieces` with those of vocabulary tensors made pieces of a tensor of `rows` rows (a checkpoint's):
    the part past `rows` left out (on load it keeps its value). Other pieces, and all with `rows`
    None, unchanged."""
    if rows is None:
        return pieces
    out = []
    for piece in pieces:
        if not is_vocabulary(piece.name) or piece.global_shape[0] == rows:
            out.append(piece)
        elif piece.offsets[0] < rows:
            kept = min(piece.sizes[0], rows - piece.offsets[0])
            out.append(
                dataclasses.replace(
                    piece,
                    global_shape=(rows,) + piece.global_shape[1:],
                    sizes=(kept,) + piece.sizes[1:],
                    tensor=lambda piece=piece, kept=kept: piece.tensor()[:kept],
                )
            )
    return out


def rows_note(where: str, saved: int | None, rows: int, vocab_size: int) -> str | None:
    """The note line for vocabulary tensors of `saved` rows read as `rows` (None: nothing to say)."""
    if saved is None or saved == rows:
        return None
    padded = f"--vocab-size {vocab_size} padded to {rows} rows here"
    if saved < rows:
        return (
            f"> note: {where}: vocabulary rows {saved}..{rows - 1} are not in the checkpoint ({saved} rows; "
            f"{padded}): they start from their initial values, as Megatron initialises padding"
        )
    return f"> note: {where}: vocabulary rows {rows}..{saved - 1} of the checkpoint dropped (padding; {padded})"


def resized_rows(tensor: torch.Tensor, rows: int, spec: InitSpec, seed: int, name: str) -> torch.Tensor:
    """The whole vocabulary tensor `tensor` with `rows` rows: cut, or extended by the initial values of
    the rows it lacks (`spec`: the parameter's full InitSpec at `rows` rows, drawn from `seed`). A meta
    tensor (shape only) gives one."""
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    out = torch.empty((rows,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    if tensor.is_meta:
        return out
    initialize_(out, spec, seed, name)
    out[: tensor.shape[0]] = tensor
    return out
