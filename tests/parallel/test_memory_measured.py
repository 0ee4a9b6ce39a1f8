"""The certain part of the memory estimate equals what our trainer really holds, byte for byte, per rank, on CPU.

Tiny GPT (dropout on: CPU attention takes the math path) and Llama (GQA, RoPE, SwiGLU,
RMSNorm; CPU flash path) under DP, TP, TP+SP, CP (ring attention, also with TP+SP), PP,
interleaved and uneven PP, ZB-V's V placement (also DP2 with the distributed optimizer),
recomputation, bf16, the distributed optimizer (bucket padding,
several buckets, an embedding tied across stages, sharded over dp x cp), the offload
optimizer (full, and f = 0.5 whose whole chunks the static policy picks, also under pp x vpp)
and Megatron-FSDP's sharding strategies (optim_grads; optim_grads_params at DP2, TP2+SP x DP2,
CP2 x DP2, PP2 x VPP2 x DP2 and with half the optimizer offloaded: weights are the kept shards),
and host-resident chunks (gradient and parameter shards on host at DP2 and TP2+SP x DP2, host
gradients under optim_grads: the host column is the host slab), and the fused LM head + cross-entropy
(TP2+SP; sharded parameters, bf16).
Per rank, after one training iteration: parameters, weights, gradient buffers, optimizer
state on the device and on host (offloaded masters, moments and gradient copies) summed from
the tensors, and the peak of saved activations over the pipeline schedule
counted with saved_tensors_hooks (see tools/bench/estimator_accuracy.py, which prints the table),
each equal to the estimate exactly; so is the number of microbatch-chunks in flight. Transients
and allowances are not checked (CPU has no allocator statistics). One gloo world per size runs
all its layouts.
"""

import pytest

from tests.distributed import run_distributed
from tools.bench.estimator_accuracy import COMPONENTS, LAYOUTS, compare, measure_layouts

CASES = [(world, name, model) for world, layouts in LAYOUTS.items() for name, model, _ in layouts]


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
        for component in COMPONENTS + ("peak_microbatches",):
            m, e = measured[component], estimated[component]
            assert e == m, f"rank {row['rank']} {component}: measured {m}, estimated {e}"
