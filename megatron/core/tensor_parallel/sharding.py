"""How a parameter relates to its full-size tensor: its shard and its initialisation.

Every parameter carries an `InitSpec` (attribute `param.init_spec`). The full
tensor is generated from a seed derived from (seed, fully qualified name), which
is the same in every parallel layout, and this rank keeps `ShardSpec.shard(full)`.
Tests use the same `shard()` to compare a tp shard's gradient with the slice of a
one-process gradient.
"""
from __future__ import annotations

import hashlib
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

    kind: 'normal' (mean 0, `std`), 'zeros' or 'ones'. `valid_rows` limits the
    random part to the first rows (the real vocabulary of a padded embedding); the
    padding rows are zero, so padding never depends on the layout. `seed_name`
    replaces the parameter's own name as seed source (the tied output-layer copy
    on the last pipeline stage starts equal to the input embedding).
    """

    full_shape: tuple
    kind: str = "normal"
    std: float = 0.02
    shard: ShardSpec | None = None
    valid_rows: int | None = None
    seed_name: str | None = None


def seed_for(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name), stable across processes and Python versions."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_tensor(spec: InitSpec, seed: int, name: str, device) -> torch.Tensor:
    """The full-size fp32 initial value of a parameter, identical in every layout."""
    if spec.kind == "zeros":
        return torch.zeros(spec.full_shape, device=device)
    if spec.kind == "ones":
        return torch.ones(spec.full_shape, device=device)
    if spec.kind != "normal":
        raise ValueError(f"unknown init kind {spec.kind!r}")
    generator = torch.Generator(device=device)
    generator.manual_seed(seed_for(seed, spec.seed_name or name))
    rows = spec.valid_rows if spec.valid_rows is not None else spec.full_shape[0]
    values = torch.empty((rows,) + tuple(spec.full_shape[1:]), device=device)
    values.normal_(0.0, spec.std, generator=generator)
    if rows == spec.full_shape[0]:
        return values
    padded = torch.zeros(spec.full_shape, device=device)
    padded[:rows] = values
    return padded


def shard_of(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of a full-size tensor that `param` holds on this rank."""
    spec: InitSpec = param.init_spec
    return spec.shard.shard(full) if spec.shard is not None else full


@torch.no_grad()
def initialize_parameters(module: torch.nn.Module, seed: int) -> None:
    """Set every parameter of `module` from its InitSpec; names are fully qualified."""
    for name, param in module.named_parameters():
        full = full_tensor(param.init_spec, seed, name, param.device)
        param.copy_(shard_of(param, full).to(param.dtype))


def make_param(shape, spec: InitSpec, dtype, device, **attrs) -> torch.nn.Parameter:
    """An uninitialised parameter of this rank's `shape` tagged with its InitSpec and attributes."""
    param = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    param.init_spec = spec
    for key, value in attrs.items():
        setattr(param, key, value)
    return param
