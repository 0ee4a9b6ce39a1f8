"""The model variants of Megatron's GPT/Llama scripts reproduce the one-process run in every
kind of layout (tensor + sequence, pipeline, context, distributed optimizer): losses of 5
iterations and all gradients of iteration 1 within 1e-5, from bit-identical initial weights."""

from __future__ import annotations

import pytest
import torch

from megatron.training.arguments.parser import parse_run_config
from tests.distributed import run_distributed
from tests.parallel.layouts import model_flags, shard, train_many

VARIANTS = {
    "llama": [
        "--apply-layernorm-1p",
        "--qk-layernorm",
        "--add-qkv-bias",
        "--rotary-percent",
        "0.5",
        "--rotary-interleaved",
        "--rope-scaling",
        "--rope-scaling-factor",
        "4",
        "--decoupled-lr",
        "1e-2",
    ],
    "gpt": ["--apply-layernorm-1p", "--qk-layernorm", "--no-position-embedding"],
}
LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "cp2": ["--context-parallel-size", "2"],
    "dp2-distopt": ["--use-distributed-optimizer"],
}


# --kernel-impl triton (the interpreter) against the same layout's torch paths (auto on CPU): RoPE
# (interleaved, half the channels, Llama-3 scaled) of each cp rank's own chunks under the ring, and
# SwiGLU on tp shards under sequence parallelism. The norms' own switch keeps them on torch (it wins over
# --kernel-impl): their interpreted kernel would take 18 s an iteration here (tests/kernels covers them).
KERNEL_LAYOUTS = ("cp2", "tp2-sp")
TRITON = ["--kernel-impl", "triton", "--normalization-impl", "torch"]
KERNEL_ITERATIONS = 2  # the interpreter's time; iteration 2 already runs on updated weights


def _run(layout: str, model: str, *kernels) -> tuple:
    flags = VARIANTS[model] + LAYOUTS[layout]
    return (model, flags + TRITON, KERNEL_ITERATIONS) if kernels else (model, flags)


@pytest.fixture(scope="module")
def results():
    out = {"reference": run_distributed(1, train_many, [(m, f) for m, f in VARIANTS.items()])}
    keys = [(layout, m) for layout in LAYOUTS for m in VARIANTS] + [(k, "llama", "triton") for k in KERNEL_LAYOUTS]
    runs = [_run(*key) for key in keys]
    per_rank = run_distributed(2, train_many, runs)
    for index, key in enumerate(keys):
        out[key] = [rank_results[index] for rank_results in per_rank]
    return out


@pytest.mark.parametrize("model", list(VARIANTS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_variant_layout_matches_one_process(results, layout, model):
    reference = results["reference"][0][list(VARIANTS).index(model)]
    for rank, out in enumerate(results[(layout, model)]):
        for it, (loss, expected) in enumerate(zip(out["losses"], reference["losses"]), start=1):
            assert abs(loss - expected) <= 1e-5 * abs(expected), f"rank {rank} iteration {it}: {loss} vs {expected}"
        if layout == "dp2-distopt":
            continue  # the distributed optimizer keeps only this rank's shard of each gradient
        for name, (grad, spec) in out["grads"].items():
            expected = shard(reference["grads"][name][0], spec)
            # the key norm's bias has a zero gradient (softmax ignores a shift shared by all keys): rounding only
            assert (grad - expected).norm() <= 1e-5 * expected.norm() + 1e-9, f"rank {rank} {name}"
            assert torch.equal(out["initial"][name][0], shard(reference["initial"][name][0], spec)), name


@pytest.mark.parametrize("layout", KERNEL_LAYOUTS)
def test_triton_kernels_match_torch_paths_in_layout(results, layout):
    """Same losses (1e-5 relative, fp32) and iteration-1 gradients (1e-5 of each norm) with every Triton
    kernel forced as with every torch path: on CPU without the flag each op runs its torch path."""
    defaults, argv = model_flags("llama", VARIANTS["llama"])
    paths = parse_run_config(argv, defaults, 1).model.kernel_paths("cpu")
    assert {paths.rope.impl, paths.swiglu.impl, paths.norm.impl} == {"torch"}
    for rank, (out, torch_out) in enumerate(zip(results[(layout, "llama", "triton")], results[(layout, "llama")])):
        assert len(out["losses"]) == KERNEL_ITERATIONS
        for it, (loss, expected) in enumerate(zip(out["losses"], torch_out["losses"]), start=1):
            assert abs(loss - expected) <= 1e-5 * abs(expected), f"rank {rank} iteration {it}: {loss} vs {expected}"
        for name, (grad, _) in out["grads"].items():
            expected = torch_out["grads"][name][0]
            assert (grad - expected).norm() <= 1e-5 * expected.norm() + 1e-9, f"rank {rank} {name}"
