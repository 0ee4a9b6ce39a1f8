"""Zero-bubble pipeline schedules (--pipeline-schedule zb-h1 / interleaved-zb / zbv) reproduce the one-process run.

Their weight-gradient (W) steps run after later microbatches' backwards, so these layouts check what
deferral could break: gradients of one chunk added in microbatch order, data-parallel buckets reduced
only after each chunk's last W step (with --overlap-grad-reduce, the distributed optimizer and
sharded gradients), tied embeddings (GPT), uneven first/last stages, sequence and context
parallelism, and MoE experts under expert parallelism; under zbv's V placement also the local hand-off
on the last rank and both ends of a tied embedding on rank 0. Losses of 5 iterations, the iteration-1 grad
norm and gradients (only this rank's shard of them is whole with the distributed optimizer and sharded
gradients: there, every parameter after the last step), within 1e-5 relative (tests/parallel/layouts.py),
and some rank really deferred a W step past a later backward.
"""

from __future__ import annotations

import pytest

from megatron.core.pipeline_parallel.schedules import ActionKind
from tests.distributed import run_distributed
from tests.parallel.layouts import assert_final_weights_match, assert_matches_one_process, build_trainer, train

PP2 = ["--pipeline-model-parallel-size", "2"]
PP4 = ["--pipeline-model-parallel-size", "4"]
VPP = ["--num-layers-per-virtual-pipeline-stage", "1"]
ZBH1 = ["--pipeline-schedule", "zb-h1"]
IZB = ["--pipeline-schedule", "interleaved-zb"]
ZBV = ["--pipeline-schedule", "zbv"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
CP2 = ["--context-parallel-size", "2"]
UNEVEN = ["--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "1"]
DIST_OPT = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "3000"]
SHARDED_GRADS = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "1e-2"]
EP2 = ["--expert-model-parallel-size", "2"]

LAYOUTS = {
    2: {
        "pp2-zbh1": ("llama", PP2 + ZBH1),
        "gpt-pp2-zbh1-tied": ("gpt", PP2 + ZBH1),
        "pp2-vpp2-izb": ("llama", PP2 + VPP + IZB),
        "gpt-pp2-vpp2-izb-tied": ("gpt", PP2 + VPP + IZB),
        "pp2-uneven-zbh1": ("llama", PP2 + UNEVEN + ZBH1),
        "pp2-zbv": ("llama", PP2 + ZBV),
        "gpt-pp2-zbv-tied": ("gpt", PP2 + ZBV),
        "pp2-uneven-zbv": ("llama-8", PP2 + UNEVEN + ZBV),  # stages of 3, 2, 2 and 1 layers; 8 microbatches
    },
    4: {
        "pp4-zbh1": ("llama", PP4 + ZBH1),
        "tp2-sp-pp2-zbh1": ("llama", TP2_SP + PP2 + ZBH1),
        "cp2-pp2-vpp2-izb": ("llama", CP2 + PP2 + VPP + IZB),
        "pp2-dp2-distopt-izb": ("llama", PP2 + VPP + DIST_OPT + IZB),
        "pp2-dp2-sharded-grads-zbh1": ("llama", PP2 + SHARDED_GRADS + ZBH1),
        "moe-ep2-pp2-zbh1": ("llama-moe", PP2 + EP2 + ZBH1),
        "pp4-zbv": ("llama-8", PP4 + ZBV),
        "tp2-sp-pp2-zbv": ("llama", TP2_SP + PP2 + ZBV),
        "cp2-pp2-zbv": ("llama", CP2 + PP2 + ZBV),
        "pp2-dp2-distopt-zbv": ("llama-gbs16", PP2 + DIST_OPT + ZBV),  # 4 microbatches per dp rank: some W deferred
        "moe-ep2-pp2-zbv": ("llama-moe-gbs16", PP2 + EP2 + ZBV),
    },
}
GBS16 = ["--global-batch-size", "16"]
REFERENCES = {
    "llama": [],
    "gpt": [],
    "llama-moe": MOE,
    "llama-8": ["--num-layers", "8"] + GBS16,
    "llama-gbs16": GBS16,
    "llama-moe-gbs16": MOE + GBS16,
}


def _model(name: str) -> str:
    return name.split("-")[0]


def _runs(rank: int, runs: list) -> list[dict]:
    out = []
    for model, flags in runs:
        result = train(_model(model), REFERENCES[model] + flags)
        steps = build_trainer(_model(model), REFERENCES[model] + flags).executor.steps
        result["deferred"] = _deferred_weight_steps(steps)
        out.append(result)
    return out


def _deferred_weight_steps(steps) -> int:
    """WEIGHT steps that run after a later microbatch's BACKWARD on the same chunk."""
    backward_seen, deferred = {}, 0
    for step in steps:
        action = step[0]
        if action.kind is ActionKind.BACKWARD:
            backward_seen.setdefault(action.chunk, set()).add(action.microbatch)
        elif action.kind is ActionKind.WEIGHT:
            deferred += any(mb > action.microbatch for mb in backward_seen.get(action.chunk, ()))
    return deferred


@pytest.fixture(scope="module")
def results():
    out = {}
    references = run_distributed(1, _runs, [(model, []) for model in REFERENCES])[0]
    for model, reference in zip(REFERENCES, references):
        out[("reference", model)] = reference
    for world, layouts in LAYOUTS.items():
        per_rank = run_distributed(world, _runs, list(layouts.values()))
        for index, name in enumerate(layouts):
            out[(name, None)] = [rank_results[index] for rank_results in per_rank]
    return out


CASES = [(name, model) for layouts in LAYOUTS.values() for name, (model, _) in layouts.items()]


@pytest.mark.parametrize("layout,model", CASES, ids=[name for name, _ in CASES])
def test_zero_bubble_layout_matches_one_process(results, layout, model):
    ranks, reference = results[(layout, None)], results[("reference", model)]
    if "distopt" in layout or "sharded" in layout or "moe" in layout:
        for rank, out in enumerate(ranks):
            assert_final_weights_match(rank, out, reference, lr=3e-3)
    else:
        assert_matches_one_process(ranks, reference)
    assert any(rank["deferred"] > 0 for rank in ranks), "no WEIGHT step was deferred past a later backward"
