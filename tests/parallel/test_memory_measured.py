"""The memory estimate equals what our trainer really holds, per rank, on CPU.

Tiny GPT (dropout on: CPU attention takes the math path) and Llama (GQA, RoPE, SwiGLU,
RMSNorm; CPU flash path) under DP, TP, TP+SP, PP, interleaved PP, recomputation and bf16.
Per rank, after one training iteration: parameters, weights, gradient buffers and optimizer
state summed from the tensors, and the peak of saved activations over the pipeline schedule
counted with saved_tensors_hooks (see tools/bench/estimator_accuracy.py, which prints the table).
One gloo world per size runs all its layouts.
"""
import pytest

from tests.distributed import run_distributed
from tools.bench.estimator_accuracy import COMPONENTS, LAYOUTS, compare, measure_layouts

CASES = [(world, name, model) for world, layouts in LAYOUTS.items() for name, model, _ in layouts]
TOLERANCE = 0.02


@pytest.fixture(scope="module")
def rows():
    out = {}
    for world, layouts in LAYOUTS.items():
        for row in compare(world, layouts, run_distributed(world, measure_layouts, layouts)):
            out.setdefault(row["layout"], []).append(row)
    return out


@pytest.mark.parametrize("world,name,model", CASES, ids=[f"{m}-{n}" for _, n, m in CASES])
def test_estimate_matches_measurement(rows, world, name, model):
    ranks = rows[f"{model} {name}"]
    assert len(ranks) == world
    for row in ranks:
        measured, estimated = row["measured"], row["estimate"]
        for component in COMPONENTS:
            m, e = measured[component], estimated[component]
            assert abs(e - m) <= TOLERANCE * m, f"rank {row['rank']} {component}: measured {m}, estimated {e}"
        assert measured["peak_microbatches"] == estimated["peak_microbatches"], f"rank {row['rank']}"
