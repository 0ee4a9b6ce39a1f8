"""Every parallel layout reproduces the one-process run: losses of 5 iterations, the grad
norm and all gradients of iteration 1 (fp32, within 1e-5 relative), and starts from the same
weights."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.parallel.layouts import assert_fp8_tracks_one_process, assert_matches_one_process, train_many

TP2 = ["--tensor-model-parallel-size", "2"]
TP4 = ["--tensor-model-parallel-size", "4"]
SP = ["--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
PP4 = ["--pipeline-model-parallel-size", "4"]
VPP = ["--num-layers-per-virtual-pipeline-stage", "1"]

SMALL_BUCKETS = ["--ddp-bucket-size", "3000"]  # several buckets, each reduced when its gradients are ready
VPP_GROUP4 = ["--num-virtual-stages-per-pipeline-rank", "2", "--microbatch-group-size-per-virtual-pipeline-stage", "4"]

CP2 = ["--context-parallel-size", "2"]
CP4 = ["--context-parallel-size", "4"]
UNEVEN = ["--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "1"]
SPLIT = ["--split-backward"]  # weight gradients after the input gradient is sent
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]

LAYOUTS = {
    2: {
        "dp2": [],
        "tp2": TP2,
        "tp2-sp": TP2 + SP,
        "tp2-sp-ce-fusion": TP2 + SP + ["--cross-entropy-loss-fusion"],  # fused LM head + loss, chunked (gpt)
        # the same with its Triton reductions (interpreter) against the one-process torch path: --kernel-impl
        # triton, the other ops kept on torch by their own switches (they have layout tests of their own)
        "tp2-sp-ce-fusion-triton": TP2
        + SP
        + ["--cross-entropy-loss-fusion", "--kernel-impl", "triton", "--attention-backend", "torch"]
        + ["--normalization-impl", "torch", "--no-rope-fusion", "--no-bias-swiglu-fusion"],
        "pp2": PP2,
        # the fused head on the last stage, its weight gradient into main_grad (gpt: the embedding tied across
        # stages), the split backward's WEIGHT steps around it
        "pp2-vpp2-split-ce-fusion": PP2 + VPP + SPLIT + ["--cross-entropy-loss-fusion"],
        "pp2-vpp2": PP2 + VPP,
        "pp2-vpp2-g4": PP2 + VPP_GROUP4,
        "pp2-uneven": PP2 + UNEVEN,
        "pp2-split": PP2 + SPLIT,
        "pp2-vpp2-split": PP2 + VPP + SPLIT,
        "pp2-split-recompute": PP2 + SPLIT + RECOMPUTE,
        "cp2": CP2,
        "cp2-allgather": CP2 + ["--cp-comm-type", "all_gather"],
    },
    4: {
        "dp4-buckets": SMALL_BUCKETS,
        "tp4": TP4,
        "tp4-sp": TP4 + SP,
        "tp2-dp2": TP2 + SP,
        "pp4": PP4,
        "cp4": CP4,
        "cp2-dp2": CP2,
        "cp2-pp2-split": CP2 + PP2 + SPLIT,
    },
    8: {
        "tp2-pp2-vpp2-dp2": TP2 + SP + PP2 + VPP,
        "tp2-cp2-pp2-vpp2": TP2 + SP + CP2 + PP2 + VPP,
        "tp2-pp2-vpp2-dp2-split": TP2 + SP + PP2 + VPP + SPLIT,
    },
}
MODELS = ("gpt", "llama")
CASES = [(world, name, model) for world, layouts in LAYOUTS.items() for name in layouts for model in MODELS]


@pytest.fixture(scope="module")
def results():
    """One process group per world size runs every layout of that size, for both models."""
    out = {}
    for world, layouts in [(1, {"reference": []})] + list(LAYOUTS.items()):
        runs = [(model, flags) for flags in layouts.values() for model in MODELS]
        per_rank = run_distributed(world, train_many, runs)
        for index, (name, model) in enumerate((n, m) for n in layouts for m in MODELS):
            out[(name, model)] = [rank_results[index] for rank_results in per_rank]
    return out


@pytest.mark.parametrize("world,layout,model", CASES, ids=[f"{model}-{layout}" for _, layout, model in CASES])
def test_layout_matches_one_process(results, world, layout, model):
    assert_matches_one_process(results[(layout, model)], results[("reference", model)][0])
    split = "split" in layout  # --split-backward layouts really run WEIGHT steps, the others none
    assert all((rank["weight_steps"] > 0) == split for rank in results[(layout, model)])


PRECISIONS = {"bf16": ["--bf16"], "fp16": ["--fp16", "--initial-loss-scale", "4096"]}
LOW_PRECISION_LAYOUTS = {"tp2-sp": TP2 + SP, "pp2-vpp2": PP2 + VPP, "pp2-vpp2-split": PP2 + VPP + SPLIT}
# FP8 recipes (fp32 weights, so that only FP8 casts differ from the fp32 runs above) and their layouts; blockwise
# under cp is left out: its weight-gradient blocks of 128 tokens are this rank's tokens (docs/fp8.md)
FP8 = {
    "fp8-delayed": ["--fp8-format", "hybrid"],
    "fp8-tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "fp8-blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
}
# tp2-sp-casts-triton: the FP8 casts in Triton (kernels/fp8_cast.py, kernels/fp8_blocks.py: the interpreter; the
# other ops on torch)
CASTS_TRITON = ["--kernel-impl", "triton", "--attention-backend", "torch", "--normalization-impl", "torch"]
FP8_LAYOUTS = {
    "tp2-sp": TP2 + SP,
    "cp2": CP2,
    "dp2": [],
    "pp2-vpp2": PP2 + VPP,
    "tp2-sp-casts-triton": TP2 + SP + CASTS_TRITON + ["--no-rope-fusion", "--no-bias-swiglu-fusion"],
}
FP8_CASES = [(layout, p) for layout in FP8_LAYOUTS for p in FP8 if not (layout == "cp2" and p == "fp8-blockwise")]


@pytest.fixture(scope="module")
def low_precision_results():
    """bf16/fp16 and FP8 runs, one process group per world size."""
    runs = {
        1: [("reference", p) for p in (*PRECISIONS, *FP8)],
        2: [(layout, p) for layout in LOW_PRECISION_LAYOUTS for p in PRECISIONS] + FP8_CASES,
    }
    layouts, precisions = {**LOW_PRECISION_LAYOUTS, **FP8_LAYOUTS, "reference": []}, {**PRECISIONS, **FP8}
    out = {}
    for world, names in runs.items():
        flags = [("llama", precisions[p] + layouts[layout]) for layout, p in names]
        per_rank = run_distributed(world, train_many, flags)
        for index, name in enumerate(names):
            out[name] = [rank[index] for rank in per_rank]
    return out


@pytest.mark.parametrize("layout", list(LOW_PRECISION_LAYOUTS))
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_low_precision_layout_tracks_one_process(low_precision_results, layout, precision):
    """bf16 / fp16 weights with fp32 master weights and reduction: the same losses as one
    process up to the low-precision rounding of different summation orders."""
    reference = low_precision_results[("reference", precision)][0]["losses"]
    losses = low_precision_results[(layout, precision)][-1]["losses"]
    for it, (loss, expected) in enumerate(zip(losses, reference), start=1):
        assert abs(loss - expected) <= 2e-3 * abs(expected), f"iteration {it}: {loss} vs {expected}"


@pytest.mark.parametrize("layout,recipe", FP8_CASES, ids=[f"{r}-{layout}" for layout, r in FP8_CASES])
def test_fp8_layout_matches_one_process(low_precision_results, layout, recipe):
    """FP8 scales reduced over the ranks holding one tensor: every rank tracks the one-process FP8 run
    (layouts.py `assert_fp8_tracks_one_process`)."""
    reference = low_precision_results[("reference", recipe)][0]
    for rank, out in enumerate(low_precision_results[(layout, recipe)]):
        assert_fp8_tracks_one_process(rank, out, reference)
    assert bool(reference["fp8_histories"]) == (recipe == "fp8-delayed")
