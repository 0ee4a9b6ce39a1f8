"""The FP8 recipe itself, on CPU: Megatron's flags, defaults and refusals; scales, saturation, margins, the amax
history; block scales on the full tensor's grid; which tensor is quantised in which pass, in which format."""

from __future__ import annotations

import pytest
import torch

from megatron.core.fp8.delayed import update_delayed_scaling
from megatron.core.fp8.gemm import emulated_mm
from megatron.core.fp8.linear import Fp8Gemms
from megatron.core.fp8.recipe import GRAD, Fp8Recipe
from megatron.core.fp8.scaling import block_amax, cast, current_scale, power_of_two_scale, quantize_blocks
from megatron.core.tensor_parallel.initialization import InitSpec
from megatron.core.tensor_parallel.layers import linear
from megatron.training.arguments.parser import GPT_DEFAULTS, parse_run_config
from tests.unit.test_arguments import TINY

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def parse(extra, world_size=1):
    return parse_run_config(TINY + ["--hidden-size", "64", "--micro-batch-size", "1"] + extra, GPT_DEFAULTS, world_size)


def test_megatron_defaults():
    recipe = parse(["--fp8-format", "hybrid"]).model.fp8
    assert recipe == Fp8Recipe(format="hybrid")
    assert (recipe.recipe, recipe.margin, recipe.amax_history_len, recipe.amax_compute_algo, recipe.wgrad) == (
        "delayed",
        0,
        1,
        "most_recent",
        True,
    )
    assert parse([]).model.fp8 is None
    flags = ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--no-fp8-wgrad", "--first-last-layers-bf16"]
    recipe = parse(flags + ["--num-layers-at-end-in-bf16", "2"]).model.fp8
    assert (recipe.format, recipe.recipe, recipe.wgrad, recipe.num_layers_at_end_in_bf16) == (
        "e4m3",
        "tensorwise",
        False,
        2,
    )
    assert [recipe.layer_in_fp8(i, 4) for i in range(4)] == [False, True, False, False]
    assert recipe.dtype(GRAD) == E4M3 and Fp8Recipe(format="hybrid").dtype(GRAD) == E5M2


FP8_ERRORS = [
    (
        ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"],
        1,
        "--fp8-recipe mxfp8 is not supported here: MXFP8 needs Blackwell",
    ),
    (["--fp8-recipe", "tensorwise"], 1, "--fp8-recipe needs --fp8-format e4m3 or hybrid"),
    (
        ["--fp8-format", "hybrid", "--num-experts", "4", "--moe-grouped-gemm", "--disable-bias-linear"],
        1,
        "--fp8-format with --moe-grouped-gemm is not built",
    ),
    (
        ["--fp8-format", "hybrid", "--first-last-layers-bf16"],
        1,
        "--first-last-layers-bf16 is not supported with --fp8-recipe delayed",
    ),
    (["--fp8-format", "hybrid", "--fp8-param-gather"], 1, "--fp8-param-gather needs sharded parameters"),
    (
        ["--fp8-format", "hybrid", "--ffn-hidden-size", "40"],
        1,
        "linear_fc1's output per tp rank is 40, not divisible by 16",
    ),
    (["--fp8-format", "hybrid", "--seq-length", "24"], 1, "tokens of a microbatch per cp rank"),
    (
        [
            "--fp8-format",
            "e4m3",
            "--fp8-recipe",
            "tensorwise",
            "--first-last-layers-bf16",
            "--num-layers-at-start-in-bf16",
            "5",
        ],
        1,
        "--num-layers-at-start-in-bf16 (5) must be between 0 and the layers per pipeline stage (4)",
    ),
    (["--fp8-format", "hybrid", "--fp8-amax-history-len", "0"], 1, "--fp8-amax-history-len must be >= 1"),
    (["--fp8-format", "e5m2"], 1, "invalid choice: 'e5m2'"),
]


@pytest.mark.parametrize("extra,world,message", FP8_ERRORS, ids=[m[:40] for _, _, m in FP8_ERRORS])
def test_bad_fp8_flags_get_one_line(extra, world, message):
    with pytest.raises(ValueError) as info:
        parse(extra, world)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_fp8_param_gather_is_noted_with_the_distributed_optimizer():
    run = parse(["--fp8-format", "hybrid", "--fp8-param-gather", "--use-distributed-optimizer"])
    assert run.model.fp8.param_gather and any("--fp8-param-gather" in note for note in run.notes)


def test_scales_saturation_and_zero_amax():
    assert current_scale(torch.tensor(2.0), E4M3) == 224.0
    assert current_scale(torch.tensor(0.0), E4M3) == 1.0  # an all-zero tensor keeps scale 1
    x = torch.tensor([1000.0, -1e6, 0.5, 0.0])
    assert cast(x, torch.tensor(1.0), E4M3).float().tolist() == [448.0, -448.0, 0.5, 0.0]  # saturated, not NaN
    assert cast(x, torch.tensor(100.0), E5M2).float()[:2].tolist() == [57344.0, -57344.0]  # not inf
    assert power_of_two_scale(torch.tensor([3.0, 448.0, 0.0]), E4M3).tolist() == [128.0, 1.0, 1.0]


class _Owner(torch.nn.Module):
    def __init__(self, out_features=32, in_features=48):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features) * 0.05)
        self.weight.init_spec = InitSpec((out_features, in_features))


def _layer(recipe: Fp8Recipe, **shape):
    owner = _Owner(**shape)
    owner.fp8 = Fp8Gemms(recipe, owner, weight_group=None, activation_groups=(), expert=False)
    return owner


def _run(owner, x, g):
    x = x.clone().requires_grad_()
    y = linear(x, owner.weight, None, fp8=owner.fp8)
    y.backward(g)
    return y, x.grad, owner.weight.grad


def test_delayed_scaling_history_margin_and_scale_update():
    class Mesh:
        tp_group = tp_cp_group = dp_group = etp_group = edp_group = None
        dp_size = cp_size = 1

    recipe = Fp8Recipe(format="hybrid", margin=1, amax_history_len=3, amax_compute_algo="max")
    owner = _layer(recipe)
    torch.manual_seed(0)
    amaxes = []
    for size in (4.0, 1.0, 2.0, 0.5):
        x, g = torch.randn(16, 48) * size, torch.randn(16, 32) * size / 10
        scale_before = owner.fp8_scale.clone()
        _run(owner, x, g)
        assert torch.equal(owner.fp8_scale, scale_before)  # the iteration casts with the previous scales
        amaxes.append(torch.stack([x.abs().max(), owner.weight.abs().max(), g.abs().max()]))
        update_delayed_scaling([owner], Mesh)
        window = torch.stack(amaxes[-3:][::-1])
        assert torch.equal(owner.fp8_amax_history[: len(window)], window)  # newest first, three kept
        limits = torch.tensor([448.0, 448.0, 57344.0])
        assert torch.allclose(owner.fp8_scale, limits / window.amax(0) / 2.0)  # max of the history, margin 1
    owner.fp8_amax_pending.zero_()
    recent = Fp8Recipe(format="hybrid")  # Megatron's defaults: one amax, most recent
    layer = _layer(recent)
    _run(layer, torch.full((16, 48), 2.0), torch.zeros(16, 32))  # an all-zero gradient keeps its scale
    update_delayed_scaling([layer], Mesh)
    assert layer.fp8_scale.tolist() == [224.0, (448.0 / layer.weight.detach().abs().max()).item(), 1.0]


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_which_tensor_is_quantised_in_which_pass(fmt):
    torch.manual_seed(1)
    recipe = Fp8Recipe(format=fmt, recipe="tensorwise")
    owner = _layer(recipe)
    x, g = torch.randn(16, 48), torch.randn(16, 32) * 1e-3
    y, dx, dw = _run(owner, x, g)

    def q(t, dtype):  # per-tensor current scaling
        s = current_scale(t.abs().max(), dtype)
        return cast(t, s, dtype), s.reciprocal()

    w = owner.weight.detach()
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    assert torch.equal(y, emulated_mm(*q(x, E4M3), *q(w, E4M3), torch.float32))  # fwd: input, weight in e4m3
    w_data, w_inv = q(w, E4M3)
    assert torch.equal(dx, emulated_mm(*q(g, grad_dtype), w_data.t(), w_inv, torch.float32))  # dgrad
    g_data, g_inv = q(g, grad_dtype)
    x_data, x_inv = q(x, E4M3)
    assert torch.equal(dw, emulated_mm(g_data.t(), g_inv, x_data.t(), x_inv, torch.float32))  # wgrad
    assert not torch.equal(dw, g.t() @ x)  # quantisation is visible
    # --no-fp8-wgrad: the weight gradient in the model's precision, the other two GEMMs still FP8
    owner.weight.grad = None
    owner.fp8.recipe = Fp8Recipe(format=fmt, recipe="tensorwise", wgrad=False)
    _, dx2, dw2 = _run(owner, x, g)
    assert torch.equal(dw2, g.t() @ x) and torch.equal(dx2, dx)


def test_fp8_products_stay_close_to_the_exact_ones():
    torch.manual_seed(2)
    x, g = torch.randn(64, 256), torch.randn(64, 128)
    exact = None
    for name in ("tensorwise", "blockwise", "delayed"):
        owner = _layer(Fp8Recipe(format="hybrid", recipe=name), out_features=128, in_features=256)
        if name == "delayed":  # scales from a first iteration's amaxes
            owner.fp8.has_history = True
            amaxes = torch.stack([x.abs().max(), owner.weight.detach().abs().max(), g.abs().max()])
            owner.fp8_scale.copy_(torch.tensor([448.0, 448.0, 57344.0]) / amaxes)
            owner.fp8_scale_inv.copy_(owner.fp8_scale.reciprocal())  # as delayed.py's update derives it
        y, dx, dw = _run(owner, x, g)
        exact = (x @ owner.weight.detach().t(), g @ owner.weight.detach(), g.t() @ x)
        for got, want in zip((y, dx, dw), exact):
            assert (got - want).norm() / want.norm() < 0.08, name


def test_blocks_split_across_ranks_get_the_one_process_scales():
    """A 128x128 weight block cut by a stacked (gate/up) tensor-parallel split: the pieces' block amaxes,
    max-reduced as the tp group does, are the whole tensor's."""
    torch.manual_seed(3)
    full = torch.randn(256, 96)
    whole = block_amax(full, torch.arange(256), torch.arange(96), (128, 128), (256, 96))
    pieces = []
    for rank in range(2):  # stacked=2 split: rows [r*64, r*64+64) of gate and of up
        rows = torch.cat([torch.arange(rank * 64, rank * 64 + 64), torch.arange(128 + rank * 64, 128 + rank * 64 + 64)])
        pieces.append(block_amax(full[rows], rows, torch.arange(96), (128, 128), (256, 96)))
    assert torch.equal(torch.maximum(*pieces), whole)
    data, scale_inv = quantize_blocks(full, torch.arange(256), torch.arange(96), (128, 128), (256, 96), E4M3)
    assert data.dtype == E4M3 and scale_inv.shape == full.shape
    assert torch.equal(scale_inv[0, 0], 1 / power_of_two_scale(full[:128].abs().max(), E4M3))
    assert (scale_inv.log2() == scale_inv.log2().round()).all()  # powers of two


def test_which_gemms_run_fp8_in_a_model():
    """QKV, proj, fc1, fc2 in FP8; the LM head and embeddings not; --first-last-layers-bf16 keeps layers out."""
    from megatron.core.fp8.model import attach_fp8  # noqa: F401 (the layer calls it)
    from tests.distributed import run_distributed

    def build(rank):
        from megatron.core.models.stages import build_model_chunks
        from megatron.core.parallel_state import ParallelMesh

        run = parse(["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16"])
        mesh = ParallelMesh(run.parallel.dims, "cpu")
        (model,) = build_model_chunks(run.model, mesh, 1, 1234, torch.device("cpu"), None, None)
        return sorted(name for name, m in model.named_modules() if getattr(m, "fp8", None) is not None)

    (names,) = run_distributed(1, build)
    layers = {name.split(".")[2] for name in names}
    assert layers == {"1", "2"}
    assert {name.split(".", 3)[3] for name in names} == {
        "self_attention.linear_qkv",
        "self_attention.linear_proj",
        "mlp.linear_fc1",
        "mlp.linear_fc2",
    }
