"""Canonical, layout-independent form of a model's parameters: what a checkpoint stores.

A checkpoint holds every tensor once, under its fully qualified name (pipeline
stages keep global layer indices, so names are the same in every layout), at its
global shape. A rank contributes `TensorPiece`s: boxes (offsets, sizes) of those
global tensors that it holds. The canonical form of each kind of parameter:

- vocabulary tensors (`embedding.word_embeddings.weight`, `output_layer.weight`):
  [padded vocabulary, hidden], the padding rows included, as Megatron trains them.
  The padded size depends on the saving tp; a load into a layout that pads to
  another size reads the rows both have (see `vocabulary.py`).
- `...self_attention.linear_qkv.weight/bias`: rows per query group,
  [q heads of group 0, k of group 0, v of group 0, q heads of group 1, ...],
  `head_dim` rows per head. A tp rank holds whole groups, a contiguous block of
  rows, so one piece per rank.
- `...mlp.linear_fc1.weight/bias` with SwiGLU: [2 ffn, hidden] = [gate; up]. A tp
  rank holds matching slices of both halves: two pieces.
- row-parallel weights (`linear_proj`, `linear_fc2`): [out, in], a tp rank holds
  a block of columns.
- tied embeddings: stored once as `embedding.word_embeddings.weight`; the last
  stage's copy of the output layer (its InitSpec names the embedding as
  `seed_name`) is not written, and is filled from the embedding on load.
- grouped experts (`...mlp.experts.linear_fc1.weight` [local experts, out, in]): stored as the per-expert
  tensors `...mlp.experts.local_experts.<e>.linear_fc1.weight` of the expert loop, so both load each other.
Everything else (norms, biases of row-parallel layers, position embeddings) is
whole on every rank that holds it; replicas are written once (DCP deduplicates
pieces with equal name and offsets).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from megatron.core.tensor_parallel.initialization import expert_name, held_ranges


@dataclass(frozen=True)
class TensorPiece:
    """A box of the global tensor `name`: `offsets` and `sizes` in `global_shape`.

    `tensor()` returns the local data: read when saving, written in place when
    loading (a view of a parameter), or produced on demand (a converter reading
    one tensor at a time).
    """

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    tensor: Callable[[], torch.Tensor]

    def snapshot(self) -> TensorPiece:
        """This piece with its data copied to host memory now: a background writer then writes the
        values of this moment while training goes on changing the original."""
        data = self.tensor().detach().to("cpu", copy=True)
        return dataclasses.replace(self, tensor=lambda: data)

    @classmethod
    def whole(cls, name: str, tensor: torch.Tensor) -> TensorPiece:
        """All of `tensor` (one process, or a replicated tensor)."""
        shape = tuple(tensor.shape)
        return cls(name, shape, (0,) * len(shape), shape, tensor.dtype, lambda: tensor)


def _global_intervals(held: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(global start, global stop, offset from `lo`) of the local range [lo, hi) of a dimension of
    which this rank holds the global ranges `held` (in local order); empty ones dropped."""
    out, local = [], 0
    for start, stop in held:
        a, b = max(lo, local), min(hi, local + stop - start)
        if b > a:
            out.append((start + a - local, start + b - local, a - lo))
        local += stop - start
    return out


def box_pieces(
    name: str, spec, offsets: tuple[int, ...], sizes: tuple[int, ...], data: torch.Tensor, dtype: torch.dtype
) -> list[TensorPiece]:
    """Pieces of the canonical tensor `name` (shape from the InitSpec `spec`, see module doc) held by
    the box (offsets, sizes) of this rank's local shard; `data` is that box's tensor (a view). A grouped
    parameter's box is cut into the per-expert tensors its leading dimension holds."""
    if spec.experts is not None:
        one, first = dataclasses.replace(spec, experts=None), offsets[0]
        return [
            piece
            for i in range(first, first + sizes[0])
            for piece in box_pieces(
                expert_name(name, spec.experts[i]), one, offsets[1:], sizes[1:], data[i - first], dtype
            )
        ]
    shape = list(spec.full_shape)
    held = [[(0, size)] for size in shape]
    if spec.shard is not None:
        held[spec.shard.dim] = held_ranges(spec.shard, shape[spec.shard.dim])
    pieces = []
    per_dim = (_global_intervals(h, lo, lo + n) for h, lo, n in zip(held, offsets, sizes))
    for boxes in itertools.product(*per_dim):
        view = data[tuple(slice(rel, rel + stop - start) for start, stop, rel in boxes)]
        pieces.append(
            TensorPiece(
                name,
                tuple(shape),
                tuple(start for start, _, _ in boxes),
                tuple(stop - start for start, stop, _ in boxes),
                dtype,
                lambda view=view: view,
            )
        )
    return pieces


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[int, tuple, tuple]]:
    """The elements [start, stop) of a row-major tensor of `shape`, as few boxes as rows allow: a
    partial first row, a block of whole rows, a partial last row (recursively for more dimensions).
    Each box is (flat start, offsets, sizes) and is contiguous in the flat order."""
    if stop <= start:
        return []
    if len(shape) <= 1:
        return [(start, (start,) * len(shape), (stop - start,) * len(shape))]
    inner = math.prod(shape[1:])
    first = start // inner
    if first == (stop - 1) // inner:  # within one row
        return [
            (first * inner + flat, (first,) + offsets, (1,) + sizes)
            for flat, offsets, sizes in flat_range_boxes(shape[1:], start - first * inner, stop - first * inner)
        ]
    head = [] if start % inner == 0 else flat_range_boxes(shape, start, (first + 1) * inner)
    rows = range(-(-start // inner), stop // inner)
    block = [(rows.start * inner, (rows.start,) + (0,) * (len(shape) - 1), (len(rows),) + tuple(shape[1:]))]
    return head + (block if rows else []) + flat_range_boxes(shape, max(rows.stop * inner, start), stop)


def parameter_pieces(name: str, param: torch.Tensor) -> list[TensorPiece]:
    """The pieces of the canonical tensor that this rank's shard `param` holds (see module doc).

    The name is the parameter's own, or the `seed_name` of a tied copy (the tensor it equals).
    """
    spec = param.init_spec
    return box_pieces(spec.seed_name or name, spec, (0,) * param.dim(), tuple(param.shape), param.detach(), param.dtype)


def model_pieces(named_parameters: Iterable[tuple[str, torch.Tensor]], *, tied_copies: bool) -> list[TensorPiece]:
    """Canonical pieces of a rank's parameters (all its model chunks' `named_parameters()`).

    `tied_copies`: include the last stage's copy of a tied embedding (to fill it on load);
    never written on save, where the embedding itself is stored.
    """
    pieces = []
    for name, param in named_parameters:
        if param.init_spec.seed_name is not None and not tied_copies:
            continue
        pieces.extend(parameter_pieces(name, param))
    return pieces
