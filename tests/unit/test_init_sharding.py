"""Layout-independent initialisation without the full tensor: every tp shard (dim 0, dim 1,
stacked SwiGLU gate/up, padded vocabulary) equals the slice of the one-process tensor, bit for bit,
for normal and Xavier-uniform weights; Xavier's bound and variance are those of the full tensor."""

import dataclasses
import math
import random

import pytest
import torch

from megatron.core.tensor_parallel import initialization
from megatron.core.tensor_parallel.initialization import InitSpec, ShardSpec, initialize_, make_param, use_init_method

TPS = (1, 2, 4, 8)


def full(spec: InitSpec, seed: int = 7, name: str = "w", dtype=torch.float32) -> torch.Tensor:
    out = torch.empty(spec.full_shape, dtype=dtype)
    initialize_(out, dataclasses.replace(spec, shard=None), seed, name)
    return out


def local(spec: InitSpec, shard: ShardSpec, seed: int = 7, name: str = "w", dtype=torch.float32) -> torch.Tensor:
    shape = list(spec.full_shape)
    shape[shard.dim] //= shard.num_shards
    out = torch.empty(shape, dtype=dtype)
    initialize_(out, dataclasses.replace(spec, shard=shard), seed, name)
    return out


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 8 x 4 so that small shapes cross many tile boundaries (rows and columns)."""
    monkeypatch.setattr(initialization, "TILE_COLUMNS", 4)
    monkeypatch.setattr(initialization, "TILE_ELEMENTS", 32)


def _shapes(seed: int, count: int = 6):
    rng = random.Random(seed)
    return [(8 * rng.randint(1, 9), rng.choice([1, 3, 8, 24, 37])) for _ in range(count)]


@pytest.mark.parametrize("kind", ["normal", "xavier_uniform"])
@pytest.mark.parametrize("tile_fixture", [True, False], ids=["small-tiles", "default-tiles"])
@pytest.mark.parametrize("dim,stacked", [(0, 1), (1, 1), (0, 2)], ids=["dim0", "dim1", "stacked"])
def test_every_shard_is_the_slice_of_the_one_process_tensor(request, tile_fixture, dim, stacked, kind):
    if tile_fixture:
        request.getfixturevalue("small_tiles")
    for rows, columns in _shapes(dim * 10 + stacked):
        shape = (rows * stacked, columns * 8) if dim == 1 else (rows * stacked, columns)
        spec = InitSpec(shape, kind=kind, std=0.5)
        reference = full(spec)
        for tp in TPS:
            for rank in range(tp):
                shard = ShardSpec(dim=dim, num_shards=tp, rank=rank, stacked=stacked)
                assert torch.equal(local(spec, shard), shard.shard(reference)), (shape, tp, rank)


def test_llama_shapes_at_default_tiles():
    """Real tile counts: fc1 stacked (gate/up) and fc2 (row-parallel) of a small SwiGLU MLP, in bf16."""
    for shape, dim, stacked in (((2 * 1536, 640), 0, 2), ((640, 1536), 1, 1)):
        spec = InitSpec(shape)
        reference = full(spec, dtype=torch.bfloat16)
        for tp in TPS:
            shard = ShardSpec(dim=dim, num_shards=tp, rank=tp - 1, stacked=stacked)
            assert torch.equal(local(spec, shard, dtype=torch.bfloat16), shard.shard(reference))


@pytest.mark.parametrize("kind", ["normal", "xavier_uniform"])
def test_padding_rows_are_drawn_and_padding_to_more_rows_keeps_the_first(small_tiles, kind):
    """The padded vocabulary depends on tp; the real rows (and Xavier's bound) must not. The padding
    rows are drawn like the real ones (Megatron trains them), one row per generator, so a layout that
    pads to more rows has the same first padding rows."""
    vocab, width = 50, 6
    unpadded = full(InitSpec((vocab, width), kind=kind, real_rows=vocab))
    tallest = full(InitSpec((vocab + 8 * 8 * max(TPS), width), kind=kind, real_rows=vocab))
    for tp in TPS:
        padded_rows = -(-vocab // (8 * tp)) * 8 * tp
        spec = InitSpec((padded_rows, width), kind=kind, real_rows=vocab)
        reference = full(spec)
        assert torch.equal(reference[:vocab], unpadded) and torch.equal(reference, tallest[:padded_rows])
        assert reference[vocab:].abs().min() > 0 and len(reference[vocab:].unique()) == reference[vocab:].numel()
        for rank in range(tp):
            shard = ShardSpec(dim=0, num_shards=tp, rank=rank)
            assert torch.equal(local(spec, shard), shard.shard(reference))
    if kind == "normal":  # the std of every other row (InitSpec's default 0.02)
        assert abs(tallest[vocab:].std().item() - 0.02) < 0.002


def test_names_seeds_and_tiles_differ(small_tiles):
    spec = InitSpec((32, 12))
    a = full(spec, seed=1, name="a")
    assert not torch.equal(a, full(spec, seed=1, name="b"))
    assert not torch.equal(a, full(spec, seed=2, name="a"))
    assert torch.equal(a, full(spec, seed=1, name="a"))
    assert torch.equal(a, full(dataclasses.replace(spec, seed_name="a"), seed=1, name="tied copy"))
    tiles = a.unflatten(0, (4, 8)).unflatten(2, (3, 4)).permute(0, 2, 1, 3).flatten(0, 1)
    assert len({t.sum().item() for t in tiles}) == len(tiles), "two tiles drew the same numbers"
    assert abs(full(InitSpec((512, 512), std=0.02)).std().item() - 0.02) < 1e-3


@pytest.mark.parametrize("shape", [(96, 640), (640, 1536), (3, 5, 7)])
def test_xavier_uniform_bound_and_variance_are_those_of_the_full_tensor(shape):
    """torch.nn.init.xavier_uniform_: U(-a, a) with a = sqrt(6 / (fan_in + fan_out)), fan_in =
    shape[1] and fan_out = shape[0] (each times prod(shape[2:])), so variance 2 / (fan_in + fan_out);
    a tp shard keeps the full tensor's bound, not its own smaller fans."""
    receptive = math.prod(shape[2:])
    bound = math.sqrt(6.0 / ((shape[0] + shape[1]) * receptive))
    reference = torch.empty(shape)
    torch.nn.init.xavier_uniform_(reference, generator=torch.Generator().manual_seed(0))
    values = full(InitSpec(shape, kind="xavier_uniform"), name="xavier")
    largest = torch.tensor(bound, dtype=torch.float32).item()  # the bound rounded as torch draws it
    for drawn in (values, reference):
        assert 0.99 * bound < drawn.abs().max().item() <= largest
    n = values.numel()  # the sample variance is within 5 standard errors of a^2 / 3 (uniform: sd = a^2 / sqrt(5 n))
    assert abs(values.var().item() - bound**2 / 3) < 5 * bound**2 / math.sqrt(5 * n)
    assert abs(values.mean().item()) < 5 * bound / math.sqrt(3 * n)
    if len(shape) == 2:
        shard = ShardSpec(dim=1, num_shards=4, rank=3)
        assert torch.equal(local(InitSpec(shape, kind="xavier_uniform"), shard, name="xavier"), shard.shard(values))


def test_use_init_method_changes_only_random_weights():
    """Weights (normal) become Xavier-uniform; biases and norm scales keep their constants."""
    layer = torch.nn.Module()
    layer.weight = make_param((4, 8), InitSpec((8, 8), std=0.3, shard=ShardSpec(0, 2, 1)), torch.float32, "cpu")
    layer.bias = make_param((4,), InitSpec((8,), kind="zeros"), torch.float32, "cpu")
    layer.scale = make_param((8,), InitSpec((8,), kind="ones"), torch.float32, "cpu")
    use_init_method(layer, "xavier_uniform")
    assert layer.weight.init_spec == InitSpec((8, 8), kind="xavier_uniform", std=0.3, shard=ShardSpec(0, 2, 1))
    assert [layer.bias.init_spec.kind, layer.scale.init_spec.kind] == ["zeros", "ones"]
    with pytest.raises(ValueError, match="unknown init method 'kaiming': one of normal, xavier_uniform"):
        use_init_method(layer, "kaiming")


def test_constant_kinds_and_errors():
    assert torch.equal(local(InitSpec((8,), kind="ones"), ShardSpec(0, 2, 1)), torch.ones(4))
    assert not local(InitSpec((8, 4), kind="zeros"), ShardSpec(1, 2, 0)).any()
    with pytest.raises(ValueError, match="expected a contiguous shard of shape \\(4, 4\\)"):
        initialize_(torch.empty(8, 4), InitSpec((8, 4), shard=ShardSpec(0, 2, 0)), 0, "w")
    with pytest.raises(ValueError, match="does not split into 2 x 2 equal shards"):
        initialize_(torch.empty(3, 4), InitSpec((6, 4), shard=ShardSpec(0, 2, 0, stacked=2)), 0, "w")
    with pytest.raises(ValueError, match="unknown init kind 'uniform'"):
        initialize_(torch.empty(2), InitSpec((2,), kind="uniform"), 0, "w")
    with pytest.raises(ValueError, match="xavier_uniform needs a tensor of at least 2 dimensions, got shape \\(8,\\)"):
        initialize_(torch.empty(8), InitSpec((8,), kind="xavier_uniform"), 0, "w")


def test_scratch_is_one_tile(monkeypatch):
    """However large the tensor, the only temporary allocation is one tile."""
    sizes = []
    real_empty = torch.empty

    def recording_empty(*shape, **kwargs):
        out = real_empty(*shape, **kwargs)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(initialization.torch, "empty", recording_empty)
    out = make_param((1024, 4096), InitSpec((8192, 4096), shard=ShardSpec(0, 8, 3)), torch.float32, "cpu")
    sizes.clear()
    initialize_(out, out.init_spec, 0, "w")
    assert sizes == [initialization.TILE_ELEMENTS]
