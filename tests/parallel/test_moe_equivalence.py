"""Expert parallelism reproduces the one-process MoE run, and the dispatchers move the analytic bytes.

A Mixtral-like model (softmax top-2, aux loss and z-loss with coefficients large enough that dropping either changes
the losses beyond the tolerance) and a DeepSeek-like one (sigmoid, expert bias, group-limited top-4, per-sequence
aux loss, a shared expert, a dense first layer) train 5 iterations under EP2, EP4, EP2 x DP2 (plain and --use-
distributed-optimizer), EP2 x TP2 with sequence parallelism (experts split over tp, and whole with --expert-tensor-
parallel-size 1), EP2 x PP2 (also with two virtual stages), EP2 and EP4 with CP2, EP2 x DP2 under the optim_grads
and optim_grads_params sharding strategies (experts sharded over their expert-data-parallel ranks), with half the
optimizer state offloaded to host and with --offload-policy auto placing it (one of the two chunks, dense and
expert, kept on the device), capacity-limited (dropping; and padded), with full recomputation (aux losses and
expert-bias counts taken once, in the replay), with both dispatchers: every rank's losses, the iteration-1 grad norm
(expert and dense weights counted once each) and every parameter after the last step equal the one-process run
within 1e-5 relative (tests/parallel/layouts.py), as does the logged load-balancing loss. Grouped experts (--moe-
grouped-gemm) run beside the loop in one layout of each kind (EP2, and EP2 with 32 experts top-1 so that some get no
tokens, EP4, EP2 x TP2 + SP, EP2 x DP2 with the distributed optimizer and padded to capacity, EP2 x PP2 interleaved,
EP2 x CP2): the loop's losses and grad norms within 1e-6 relative, and the one-process run's weights.
"""

from __future__ import annotations

import functools
import re

import pytest

from megatron.core.tensor_parallel.mappings import COMM_STATS
from tests.cli import TINY_LLAMA, explain, run_cli
from tests.distributed import run_distributed
from tests.parallel.layouts import (
    assert_final_weights_match,
    assert_fp8_tracks_one_process,
    build_trainer,
    canonical_tensors,
)

LR = 3e-3
MIXTRAL = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "32",
    "--moe-aux-loss-coeff",
    "1e-1",
    "--moe-z-loss-coeff",
    "1e-2",
]
DEEPSEEK = [
    "--num-experts",
    "8",
    "--moe-router-topk",
    "4",
    "--moe-ffn-hidden-size",
    "16",
    "--moe-router-score-function",
    "sigmoid",
    "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate",
    "1e-2",
    "--moe-router-num-groups",
    "4",
    "--moe-router-group-topk",
    "2",
    "--moe-router-topk-scaling-factor",
    "2.5",
    "--moe-router-load-balancing-type",
    "seq_aux_loss",
    "--moe-aux-loss-coeff",
    "1e-1",
    "--moe-shared-expert-intermediate-size",
    "32",
    "--moe-layer-freq",
    "[0,1,1,1]",
]
CAPACITY = ["--moe-expert-capacity-factor", "1.0"]  # tokens dropped per rank and microbatch, as in one process
PADDED = ["--moe-expert-capacity-factor", "0.5", "--moe-token-drop-policy", "position"]
PADDED += ["--moe-pad-expert-input-to-capacity"]
SPARSE = MIXTRAL + [
    "--num-experts",
    "32",
    "--moe-router-topk",
    "1",
    "--moe-router-pre-softmax",
]  # experts left without tokens in a microbatch
MODELS = {
    "mixtral": MIXTRAL,
    "sparse": SPARSE,
    "deepseek": DEEPSEEK,
    "mixtral-capacity": MIXTRAL + CAPACITY,
    "mixtral-padded": MIXTRAL + PADDED,
    "mixtral-fp8": MIXTRAL + ["--fp8-format", "hybrid"],  # delayed scaling: the experts' GEMMs in FP8 too
}
EP2, EP4 = ["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "4"]
A2A = ["--moe-token-dispatcher-type", "alltoall"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2, CP2 = ["--pipeline-model-parallel-size", "2"], ["--context-parallel-size", "2"]
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
OFFLOAD = ["--use-distributed-optimizer", "--optimizer-cpu-offload", "--overlap-param-gather"]
AUTO = ["--offload-policy", "auto", "--device-memory-gb", "0.00245"]  # keeps the optimizer state of 1 of 2 chunks
GROUPED = ["--moe-grouped-gemm"]
LAYOUTS = {
    2: {
        "ep2-alltoall": ("mixtral", EP2 + A2A),
        "ep2-allgather": ("mixtral", EP2),
        "ep2-alltoall-deepseek": ("deepseek", EP2 + A2A),
        "ep2-alltoall-capacity": ("mixtral-capacity", EP2 + A2A),
        "ep2-recompute-deepseek": ("deepseek", EP2 + A2A + RECOMPUTE),
        "ep2-alltoall-deepseek-grouped": ("deepseek", EP2 + A2A + GROUPED),
        "ep2-sparse": ("sparse", EP2 + A2A),
        "ep2-sparse-grouped": ("sparse", EP2 + A2A + GROUPED),
        "ep2-alltoall-fp8": ("mixtral-fp8", EP2 + A2A),
    },
    4: {
        "ep4-alltoall": ("mixtral", EP4 + A2A),
        "ep4-allgather": ("mixtral", EP4),
        "ep2-dp2-padded-alltoall": ("mixtral-padded", EP2 + A2A),
        "ep4-padded-allgather": ("mixtral-padded", EP4),
        "ep2-dp2": ("mixtral", EP2),
        "ep2-dp2-distopt": ("mixtral", EP2 + A2A + ["--use-distributed-optimizer"]),
        "ep2-tp2-sp-allgather": ("mixtral", EP2 + TP2_SP),
        "ep2-tp2-sp-alltoall": ("mixtral", EP2 + TP2_SP + A2A),
        "ep2-tp2-sp-etp1": ("mixtral", EP2 + TP2_SP + A2A + ["--expert-tensor-parallel-size", "1"]),
        "ep2-tp2-sp-deepseek": ("deepseek", EP2 + TP2_SP),
        "ep2-pp2": ("mixtral", EP2 + A2A + PP2),
        "ep2-pp2-vpp2": ("deepseek", EP2 + A2A + PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"]),
        "ep2-cp2-alltoall": ("mixtral", EP2 + A2A + CP2),
        "ep2-dp2-optim-grads": ("mixtral", EP2 + A2A + FSDP + ["optim_grads"]),
        "ep2-dp2-optim-grads-params": ("deepseek", EP2 + FSDP + ["optim_grads_params"]),
        "ep2-tp2-sp-optim-grads-params": ("mixtral", EP2 + TP2_SP + A2A + FSDP + ["optim_grads_params"]),
        "ep2-dp2-offload-half": ("deepseek", EP2 + A2A + OFFLOAD + ["--optimizer-offload-fraction", "0.5"]),
        "ep2-dp2-offload-auto": ("deepseek", EP2 + A2A + OFFLOAD + AUTO),
        "ep4-cp2-deepseek": ("deepseek", EP4 + CP2),
        "ep4-allgather-grouped": ("mixtral", EP4 + GROUPED),
        "ep2-dp2-padded-alltoall-grouped": ("mixtral-padded", EP2 + A2A + GROUPED),
        "ep2-dp2-distopt-grouped": ("mixtral", EP2 + A2A + ["--use-distributed-optimizer"] + GROUPED),
        "ep2-tp2-sp-alltoall-grouped": ("mixtral", EP2 + TP2_SP + A2A + GROUPED),
        "ep2-pp2-vpp2-grouped": (
            "deepseek",
            EP2 + A2A + PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"] + GROUPED,
        ),
        "ep2-cp2-alltoall-grouped": ("mixtral", EP2 + A2A + CP2 + GROUPED),
    },
}


def _count_empty_experts(module, args, counts: list) -> None:
    counts.append(sum(1 for n in args[1] if n == 0))


def _train(model: str, extra: list[str], iterations: int = 5) -> dict:
    trainer = build_trainer("llama", MODELS[model] + extra)
    empty = []  # local experts that got no rows, per MoE layer call
    for chunk in trainer.chunks:
        for name, module in chunk.module.named_modules():
            if name.endswith("mlp.experts"):
                module.register_forward_pre_hook(functools.partial(_count_empty_experts, counts=empty))
    losses, grad_norms, logged = [], [], []
    for iteration in range(1, iterations + 1):
        result = trainer.train_step(iteration)
        losses.append(result.loss)
        grad_norms.append(result.grad_norm)
        logged.append({name: float(value) for name, value in result.moe_losses.items()})
    trainer.optimizer.finish_param_sync()
    final = canonical_tensors(trainer)
    host = trainer.optimizer.host
    placed = None if host is None else (host.placement.counts()["optimizer"], len(trainer.optimizer.shards))
    trainer.close()
    out = {"losses": losses, "grad_norms": grad_norms, "final": final, "logged": logged, "on_host": placed}
    return out | {"empty_experts": sum(empty)}


def _train_many(rank: int, runs: list) -> list[dict]:
    return [_train(model, extra) for model, extra in runs]


@pytest.fixture(scope="module")
def results():
    out = {}
    for world, layouts in [(1, {f"reference-{m}": (m, []) for m in MODELS})] + list(LAYOUTS.items()):
        per_rank = run_distributed(world, _train_many, list(layouts.values()))
        for index, name in enumerate(layouts):
            out[name] = [rank_results[index] for rank_results in per_rank]
    return out


CASES = [name for layouts in LAYOUTS.values() for name in layouts]


@pytest.mark.parametrize("layout", CASES)
def test_expert_parallel_layout_matches_one_process(results, layout):
    model = next(m for layouts in LAYOUTS.values() for n, (m, _) in layouts.items() if n == layout)
    reference = results[f"reference-{model}"][0]
    for rank, out in enumerate(results[layout]):
        if "fp8" in layout:  # FP8 tracks one process as bf16 layouts do (layouts.py)
            assert_fp8_tracks_one_process(rank, out, reference)
            continue
        assert_final_weights_match(rank, out, reference, LR)
    if "auto" in layout:  # the placement is partial: the optimizer state of some chunks on host, not all
        assert all(0 < out["on_host"][0] < out["on_host"][1] for out in results[layout]), results[layout][0]["on_host"]
    last, expected = results[layout][-1]["logged"], reference["logged"]  # the last rank prints the log line
    name = "seq_load_balancing_loss" if model == "deepseek" else "load_balancing_loss"
    if "fp8" in layout:  # iteration 1 only: FP8 layouts drift from one process afterwards (above)
        last, expected = last[:1], expected[:1]
    for it, (mine, theirs) in enumerate(zip(last, expected), start=1):
        assert abs(mine[name] - theirs[name]) <= 1e-5 * theirs[name], (layout, it, mine, theirs)


GROUPED_CASES = [name for name in CASES if name.endswith("-grouped")]


@pytest.mark.parametrize("layout", GROUPED_CASES)
def test_grouped_experts_give_the_loops_losses_and_grad_norms(results, layout):
    loop = results[layout.removesuffix("-grouped")]
    for rank, (mine, theirs) in enumerate(zip(results[layout], loop)):
        for key in ("losses", "grad_norms"):
            for it, (a, b) in enumerate(zip(mine[key], theirs[key]), start=1):
                assert abs(a - b) <= 1e-6 * abs(b), (layout, rank, key, it, a, b)
    if "sparse" in layout:  # the case of experts without tokens is exercised
        assert all(out["empty_experts"] > 0 for out in results[layout]), [o["empty_experts"] for o in results[layout]]


def _dispatcher_bytes(rank: int, dispatcher: str) -> tuple[dict, dict]:
    """COMM_STATS bytes of one training iteration at EP2 (tp 1: only the MoE layers communicate through it)."""
    flags = MIXTRAL + EP2 + ["--moe-token-dispatcher-type", dispatcher]
    trainer = build_trainer("llama", flags)
    with COMM_STATS.counting() as stats:
        trainer.forward_backward(1)
    c = trainer.run.model
    return dict(stats.bytes), {
        "layers": c.num_layers,
        "microbatches": trainer.run.training.num_microbatches,
        "tokens": c.seq_length * trainer.run.training.micro_batch_size,
        "topk": c.moe_router_topk,
        "hidden": c.hidden_size,
        "experts": c.num_moe_experts,
    }


def test_alltoall_bytes_are_the_analytic_volume():
    """Each rank hands the all-to-all the rows it sends (every route of its tokens once: dropless, no padding),
    their weights, and in the combine the rows it received; backward the same again. Over the group the rows
    received are the rows sent, so the group's bytes are 2 x (2h + 1) x 4 per route and MoE layer call;
    the ranks' shares differ (uneven routing is not padded to the worst rank's)."""
    ranks = run_distributed(2, _dispatcher_bytes, "alltoall")
    measured = [stats["all_to_all"] for stats, _ in ranks]
    shape = ranks[0][1]
    calls = shape["layers"] * shape["microbatches"]
    routes = len(ranks) * shape["tokens"] * shape["topk"]
    assert sum(measured) == calls * 2 * routes * (2 * shape["hidden"] + 1) * 4, measured
    assert measured[0] != measured[1], measured
    assert all(set(stats) == {"all_to_all"} for stats, _ in ranks)


def test_allgather_bytes_are_the_analytic_volume():
    for measured, shape in run_distributed(2, _dispatcher_bytes, "allgather"):
        calls = shape["layers"] * shape["microbatches"]  # MoE layers x microbatches, forward and backward each
        fp32, h, e = 4, shape["hidden"], shape["experts"]
        gathered = 2 * shape["tokens"]  # the ep group's tokens
        expected = {
            # forward: tokens, weights [E] and the routing map (1 byte) gathered; backward: the combine's input
            "all_gather": calls * gathered * (2 * h * fp32 + e * fp32 + e),
            # forward: the combine; backward: the gradients of the gathered tokens and weights
            "reduce_scatter": calls * gathered * (2 * h * fp32 + e * fp32),
        }
        assert measured == expected, (measured, expected)


def test_cli_prints_megatron_moe_losses_and_the_memory_check():
    # micro batch 4: the activations set the peak (not the optimizer step), so the routing allowance shows
    proc = run_cli("pretrain_llama.py", TINY_LLAMA + MIXTRAL + ["--device-memory-gb", "1", "--micro-batch-size", "4"])
    assert proc.returncode == 0, explain(proc)
    assert "> MoE: saved activations at the balanced load" in proc.stdout  # the start-up memory check
    assert re.search(r"> memory check: estimated peak .* of device memory: fits: .*MoE routing imbalance", proc.stdout)
    lines = [line for line in proc.stdout.splitlines() if " iteration " in line and "lm loss:" in line]
    assert len(lines) == 5 and all(re.search(r"lm loss: \S+ \| load_balancing_loss: \S+ \| z_loss: ", x) for x in lines)
