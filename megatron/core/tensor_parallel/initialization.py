"""Layout-independent initialisation: a parameter's full-size initial value, and the shard of it a rank holds.

Every parameter carries an `InitSpec` (attribute `param.init_spec`). Its initial
value is defined at full size and is the same in every parallel layout; a rank
holds `ShardSpec.shard(full)` of it. Tests use the same `shard()` to compare a tp
shard's gradient with the slice of a one-process gradient.

The full tensor is never built. A random tensor, viewed as rows (dim 0) of width
prod(shape[1:]), is cut into tiles of at most TILE_ELEMENTS elements on a grid
that depends only on the width; each tile is drawn from its own generator seeded
by (seed, name, tile row, tile column). A rank draws only the tiles that overlap
its shard and copies the overlap: rows for a dim-0 (column-parallel, vocabulary)
shard, columns for a dim-1 (row-parallel) shard, both blocks of a stacked
(SwiGLU gate/up) shard. Scratch is one fp32 tile (1 MiB), whatever the tensor.
Rows past `real_rows` (Megatron's vocabulary padding, which grows with tp) are drawn like the
others but off the grid, one generator per row (seeded by (seed, name, "padding", row past the
real vocabulary, tile column)): the real rows are the same however the vocabulary is padded, and
a layout that pads to more rows has the same first padding rows.
'xavier_uniform' draws the same tiles uniformly in ±sqrt(6 / (fan_in + fan_out)) of the
full tensor (its real rows), so its shards are layout-independent too.
`make_param` allocates only this rank's shard (tools/bench/init_memory.py measures it).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """This rank's slice of a tensor split into `num_shards` along `dim`.

    `stacked` > 1 means the dimension holds that many independently split blocks
    (SwiGLU's fc1 stacks [gate; up]): each block is split and the slices stacked.
    """

    dim: int
    num_shards: int
    rank: int
    stacked: int = 1

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        if self.num_shards == 1:
            return full
        blocks = full.unflatten(self.dim, (self.stacked, full.shape[self.dim] // self.stacked))
        piece = blocks.chunk(self.num_shards, dim=self.dim + 1)[self.rank]
        return piece.flatten(self.dim, self.dim + 1)


@dataclass(frozen=True)
class InitSpec:
    """Full shape and distribution of a parameter.

    kind: 'normal' (mean 0, `std`), 'xavier_uniform' (torch.nn.init.xavier_uniform_ of
    the full tensor; `std` unused), 'zeros' or 'ones'. `real_rows`: the rows of the real
    vocabulary of a padded vocabulary tensor, drawn on the tile grid; the padding rows after
    them are drawn row by row (see the module doc), so no row depends on the layout. `seed_name`
    replaces the parameter's own name as seed source (the tied output-layer copy
    on the last pipeline stage starts equal to the input embedding). `experts`: the parameter
    stacks one tensor per expert (these global indices) along a new leading dimension, as grouped
    experts hold their weights; everything else describes one expert's tensor, which is the tensor
    `expert_name(name, e)` of the per-expert layout (initial values and checkpoints alike).
    """

    full_shape: tuple
    kind: str = "normal"
    std: float = 0.02
    shard: ShardSpec | None = None
    real_rows: int | None = None
    seed_name: str | None = None
    experts: tuple[int, ...] | None = None


def expert_name(name: str, expert: int) -> str:
    """The per-expert name of expert `expert`'s slice of the grouped parameter `name`:
    `<prefix>.linear_fc1.weight` -> `<prefix>.local_experts.<expert>.linear_fc1.weight`."""
    parts = name.split(".")
    return ".".join(parts[:-2] + ["local_experts", str(expert)] + parts[-2:])


def expert_tensors(name: str, tensor: torch.Tensor, spec: InitSpec) -> list[tuple[str, torch.Tensor, InitSpec]]:
    """(name, tensor, InitSpec) of each tensor `tensor` holds: itself, or one per expert of a grouped parameter."""
    if spec.experts is None:
        return [(name, tensor, spec)]
    if tensor.shape[0] != len(spec.experts):
        raise ValueError(f"{name}: holds {tensor.shape[0]} experts, its InitSpec names {len(spec.experts)}")
    one = dataclasses.replace(spec, experts=None)
    return [(expert_name(name, e), tensor[i], one) for i, e in enumerate(spec.experts)]


RANDOM_KINDS = ("normal", "xavier_uniform")  # also the init methods a model's weights can use
TILE_COLUMNS = 512
TILE_ELEMENTS = 1 << 18  # 512 x 512 fp32 = 1 MiB of scratch; seeding a tile costs 0.2% of drawing it (CPU)


def seed_for(seed: int, name: str, *tile: int) -> int:
    """A 63-bit seed from (seed, name, tile indices), stable across processes and Python versions."""
    digest = hashlib.sha256(":".join(map(str, (seed, name) + tile)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def tile_shape(width: int) -> tuple[int, int]:
    """(rows, columns) of the tiles of a tensor whose rows have `width` elements; layout-independent."""
    columns = min(width, TILE_COLUMNS)
    return TILE_ELEMENTS // columns, columns


def held_ranges(shard: ShardSpec | None, size: int) -> list[tuple[int, int]]:
    """The [start, stop) ranges of the full dimension `size` that `shard` keeps, in local order."""
    if shard is None or shard.num_shards == 1:
        return [(0, size)]
    if size % (shard.stacked * shard.num_shards):
        raise ValueError(
            f"dimension {shard.dim} of size {size} does not split into {shard.stacked} x "
            f"{shard.num_shards} equal shards"
        )
    block = size // shard.stacked
    piece = block // shard.num_shards
    return [(k * block + shard.rank * piece, k * block + (shard.rank + 1) * piece) for k in range(shard.stacked)]


def _overlaps(ranges: list[tuple[int, int]], step: int, first: int, limit: int):
    """(tile index, tile start, local offset, overlap start, overlap stop) of each tile of the indices
    [first, limit), cut into tiles of size `step` from `first` (the last one cut at `limit`), that
    overlaps a range; the local offset is where the overlap starts in this rank's local order."""
    local = 0
    for start, stop in ranges:
        begin, end = max(start, first), min(stop, limit)
        for index in range((begin - first) // step, -(-(end - first) // step) if end > begin else 0):
            tile = first + index * step
            lo, hi = max(begin, tile), min(end, tile + step)
            yield index, tile, local + lo - start, lo, hi
        local += stop - start


def xavier_bound(spec: InitSpec) -> float:
    """torch.nn.init.xavier_uniform_'s bound (gain 1) for the full tensor: fan_in = shape[1] and
    fan_out = shape[0], each times prod(shape[2:]). The real rows (`real_rows`) count, not the
    vocabulary padding, which grows with tp and would make the bound layout-dependent."""
    shape = spec.full_shape
    if len(shape) < 2:
        raise ValueError(f"xavier_uniform needs a tensor of at least 2 dimensions, got shape {tuple(shape)}")
    receptive = math.prod(shape[2:])
    rows = spec.real_rows if spec.real_rows is not None else shape[0]
    return math.sqrt(6.0 / ((shape[1] + rows) * receptive))


def _fill_random(out: torch.Tensor, spec: InitSpec, seed: int, name: str) -> None:
    """Draw the tiles overlapping this shard; `out` is the shard viewed as [rows, width]. The real rows
    lie on the tile grid; padding rows past them are tiles of one row, keyed by their index past the
    real vocabulary."""
    shard = spec.shard
    full_rows, width = spec.full_shape[0], math.prod(spec.full_shape[1:])
    rows_held = held_ranges(shard if shard is not None and shard.dim == 0 else None, full_rows)
    columns_held = held_ranges(shard if shard is not None and shard.dim == 1 else None, width)
    real = spec.real_rows if spec.real_rows is not None else full_rows
    tile_rows, tile_columns = tile_shape(width)
    bound = xavier_bound(spec) if spec.kind == "xavier_uniform" else None
    generator = torch.Generator(device=out.device)
    scratch = torch.empty(max(min(tile_rows, real), 1) * tile_columns, device=out.device)
    for first, stop, step, key in ((0, real, tile_rows, ()), (real, full_rows, 1, ("padding",))):
        for i, row0, local_row, r0, r1 in _overlaps(rows_held, step, first, stop):
            for j, col0, local_col, c0, c1 in _overlaps(columns_held, tile_columns, 0, width):
                shape = (min(step, stop - row0), min(tile_columns, width - col0))
                tile = scratch[: shape[0] * shape[1]].view(shape)
                generator.manual_seed(seed_for(seed, name, *key, i, j))
                if bound is None:
                    tile.normal_(0.0, spec.std, generator=generator)
                else:
                    tile.uniform_(-bound, bound, generator=generator)
                out[local_row : local_row + r1 - r0, local_col : local_col + c1 - c0].copy_(
                    tile[r0 - row0 : r1 - row0, c0 - col0 : c1 - col0]
                )


@torch.no_grad()
def initialize_(tensor: torch.Tensor, spec: InitSpec, seed: int, name: str) -> None:
    """Fill `tensor`, this rank's shard of `spec` (any dtype), with its layout-independent initial value.
    With `spec.shard` None, `tensor` is the full tensor every layout's shard is a slice of. A grouped
    parameter (`spec.experts`) gets each expert's value under that expert's per-expert name."""
    if spec.experts is not None:
        for one_name, one, one_spec in expert_tensors(name, tensor, spec):
            initialize_(one, one_spec, seed, one_name)
        return
    expected = list(spec.full_shape)
    if spec.shard is not None:
        if spec.shard.dim not in (0, 1) or (spec.shard.dim == 1 and len(expected) != 2):
            raise ValueError(
                f"{name}: only dim 0, or dim 1 of a matrix, can be sharded (got dim {spec.shard.dim} "
                f"of shape {tuple(expected)})"
            )
        expected[spec.shard.dim] //= spec.shard.num_shards
    if list(tensor.shape) != expected or not tensor.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous shard of shape {tuple(expected)}, got {tuple(tensor.shape)}")
    if spec.kind == "zeros":
        tensor.zero_()
    elif spec.kind == "ones":
        tensor.fill_(1.0)
    elif spec.kind in RANDOM_KINDS:
        _fill_random(tensor.view(expected[0], -1), spec, seed, spec.seed_name or name)
    else:
        raise ValueError(f"{name}: unknown init kind {spec.kind!r}")


def initialize_parameters(module: torch.nn.Module, seed: int) -> None:
    """Set every parameter of `module` from its InitSpec; names are fully qualified."""
    for name, param in module.named_parameters():
        initialize_(param, param.init_spec, seed, name)


def use_init_method(module: torch.nn.Module, method: str) -> None:
    """Give every weight drawn from a normal distribution the kind `method` instead. Megatron's
    --init-method-xavier-uniform replaces its init_method and output-layer init method, which draw
    every weight matrix: QKV, fc1, the attention projection and fc2, both embeddings (Megatron's
    embedding init follows init_method unless --embedding-init-method-std is given) and the untied
    output layer; biases and norms keep their constants."""
    if method not in RANDOM_KINDS:
        raise ValueError(f"unknown init method {method!r}: one of {', '.join(RANDOM_KINDS)}")
    for param in module.parameters():
        if param.init_spec.kind in RANDOM_KINDS:
            param.init_spec = dataclasses.replace(param.init_spec, kind=method)


_DEFERRED = contextvars.ContextVar("deferred_initialization", default=False)


@contextlib.contextmanager
def deferred_initialization():
    """Parameters made inside hold no memory: shape, dtype, device and InitSpec only, until the
    storage they are given is filled by `initialize_` (the gradient buffers do it bucket by
    bucket, so a rank never holds its whole model, only its shards and one bucket at a time)."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def is_deferred(param: torch.Tensor) -> bool:
    """A parameter made under `deferred_initialization` that has not been initialised yet."""
    return getattr(param, "deferred_init", False)


def make_param(shape, spec: InitSpec, dtype, device, **attrs) -> torch.nn.Parameter:
    """An uninitialised parameter of this rank's `shape` tagged with its InitSpec and attributes
    (holding no memory under `deferred_initialization`)."""
    param = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    if _DEFERRED.get():
        param.untyped_storage().resize_(0)
        param.deferred_init = True
    param.init_spec = spec
    for key, value in attrs.items():
        setattr(param, key, value)
    return param
