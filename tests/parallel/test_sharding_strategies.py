"""Megatron-FSDP's sharding strategies on our buckets reproduce the one-process run.

optim_grads (no whole fp32 gradient buffer: each bucket reduce-scattered per microbatch into the
rank's shard) and optim_grads_params (parameters sharded too, gathered around each use) at DP2
(optim_grads with --overlap-param-gather; optim_grads_params also with half the optimizer chunks
offloaded to the CPU step), DP4, TP2 x DP2 with SP (and full recomputation), PP2 (2 virtual
stages) x DP2, CP2 x DP2 and TP2 x SP x PP2 (v2) x DP2 on 8 ranks, GPT (tied embeddings) and
Llama, fp32, several microbatches, clipping active, buckets small enough that parameters
straddle shards: the loss of 5 iterations, the iteration-1 grad norm and the parameters after 5
steps match the one-process run (1e-5). After the last step each rank's buffers hold exactly
1/(dp x cp) of the padded gradients in fp32, and of the parameters under optim_grads_params: the
memory estimator's weights, gradients and optimizer bytes for the rank, exactly. bf16 and fp16
track the one-process run of their precision; an inf in one rank's gradient shard skips the fp16
step everywhere. The payload of each collective in one step is the analytic volume: per
microbatch one reduce-scatter of the gradients, and, for optim_grads_params (where a forward
holds at most a quarter of the buckets gathered at once), two all-gathers of the parameters per
microbatch without pipelining (forward, backward) and one per step with it (parameters stay
gathered from a microbatch's forward to its backward; two per microbatch with
--reshard-params-after-forward, also checked for equivalence, with --split-backward);
optim_grads gathers the parameters once, after the step; with --unsharded-grad-accumulation the
gradients are reduce-scattered once per step (and optim_grads_params with it matches one
process); so does optim_grads_params with --cross-entropy-loss-fusion, resharding after forward.
A run saved under optim_grads or optim_grads_params resumes bit for bit under it, and one saved
under optim_grads_params continues under optim_grads at TP2 as the uninterrupted run does.
torchrun with 2 ranks prints the one-rank losses and what the strategy keeps.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed.transient import TransientBuffer
from megatron.planning.estimator import estimate_memory
from megatron.training.arguments.parser import parse_run_config
from megatron.training.checkpoint import checkpoint_to_load, load_checkpoint, save_checkpoint
from megatron.training.memory_check import layout_from_run
from megatron.training.trainer import Trainer
from tests.cli import TINY_LLAMA, torchrun_matching_one_rank
from tests.distributed import run_distributed
from tests.parallel.layouts import assert_final_weights_match, build_trainer, model_flags, train
from tests.parallel.test_checkpoint_resume import _run, _steps
from tests.parallel.test_distributed_optimizer import COMMON, LR, PP2, SP, TP2, VPP, check_fp16_inf_skips_everywhere
from tools.bench.distributed_optimizer import count_collectives

FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
GRADS, PARAMS = FSDP + ["optim_grads"], FSDP + ["optim_grads_params"]
CP2 = ["--context-parallel-size", "2"]
RESHARD = ["--reshard-params-after-forward"]
UNSHARDED = ["--unsharded-grad-accumulation"]
OFFLOAD = ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]  # half the chunks stepped on the CPU
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
BOTH, GPT = ("gpt", "llama"), ("gpt",)
LAYOUTS = {  # world -> name -> (flags, models)
    2: {
        "dp2-grads-overlap-gather": (GRADS + ["--overlap-param-gather"], BOTH),
        "dp2-params": (PARAMS, BOTH),
        "dp2-params-offload": (PARAMS + OFFLOAD, GPT),
        "dp2-params-unsharded-accumulation": (PARAMS + UNSHARDED, GPT),
        # the fused output layer + loss, called as a module so that its (tied or own) weight is gathered
        "dp2-params-reshard-ce-fusion": (PARAMS + RESHARD + ["--cross-entropy-loss-fusion"], BOTH),
    },
    4: {
        "dp4-grads": (GRADS, GPT),
        "dp4-params": (PARAMS, GPT),
        "tp2-sp-dp2-params-recompute": (PARAMS + TP2 + SP + RECOMPUTE, BOTH),
        "pp2-vpp2-dp2-grads": (GRADS + PP2 + VPP, BOTH),
        "pp2-vpp2-dp2-params": (PARAMS + PP2 + VPP, BOTH),
        "cp2-dp2-params": (PARAMS + CP2, BOTH),
        "pp2-vpp2-dp2-params-reshard-split": (PARAMS + PP2 + VPP + RESHARD + ["--split-backward"], GPT),
    },
    8: {"tp2-sp-pp2-vpp2-dp2-params": (PARAMS + TP2 + SP + PP2 + VPP, GPT)},
}
PRECISIONS = {"bf16": ["--bf16"], "fp16": ["--fp16", "--initial-loss-scale", "4096"]}
CASES = [
    (world, name, model)
    for world, layouts in LAYOUTS.items()
    for name, (_, models) in layouts.items()
    for model in models
]


def _communication(rank: int, flags: list[str]) -> tuple[dict, int, int, tuple[int, int]]:
    """Payload bytes per collective kind in one step after the first; padded elements on this rank;
    microbatches per dp rank; (most buckets gathered at once when a module starts, buckets)."""
    trainer = build_trainer("gpt", COMMON + flags)
    buckets = [bucket for chunk in trainer.chunks for bucket in chunk.buffer.buckets]
    peak = [0]

    def count_gathered(*_):
        peak[0] = max(peak[0], sum(b.param_full.allocated for b in buckets if b.shards_params))

    for chunk in trainer.chunks:
        for module in chunk.module.modules():
            module.register_forward_hook(count_gathered)
    trainer.train_step(1)
    peak[0] = 0
    with count_collectives() as counts:
        trainer.train_step(2)
    return (
        counts,
        sum(c.buffer.layout.numel for c in trainer.chunks),
        trainer.run.training.num_microbatches,
        (peak[0], len(buckets)),
    )


def _runs(world: int) -> list:
    runs = [(model, COMMON + flags) for flags, models in LAYOUTS[world].values() for model in models]
    if world == 2:
        runs += [("llama", COMMON + PARAMS + precision) for precision in PRECISIONS.values()]
    return runs


def _references(rank: int) -> list:
    return [
        train(model, COMMON + flags)
        for model, flags in [(model, []) for model in BOTH] + [("llama", flags) for flags in PRECISIONS.values()]
    ]


def _train_and_estimate(model: str, flags: list[str]) -> dict:
    """`train`, plus the memory estimator's (weights, gradients, optimizer) bytes for this rank."""
    out = train(model, flags)
    defaults, argv = model_flags(model, flags)
    run = parse_run_config(argv, defaults, dist.get_world_size())
    pp_rank = run.parallel.dims.coords(dist.get_rank())["pp"]
    rank = estimate_memory(run.model, layout_from_run(run, "cpu")).ranks[pp_rank]
    out["estimate"] = (rank.weights_bytes, rank.grads_bytes, rank.optimizer_bytes)
    return out


def world_checks(rank: int, world: int) -> dict:
    out = {"runs": [_train_and_estimate(model, flags) for model, flags in _runs(world)]}
    if world == 2:
        check_fp16_inf_skips_everywhere(rank, PARAMS)
        out["communication"] = {
            name: _communication(rank, flags)
            for name, flags in (("grads", GRADS), ("params", PARAMS), ("grads-unsharded", GRADS + UNSHARDED))
        }
    if world == 4:
        out["communication"] = {
            "pp-params": _communication(rank, PARAMS + PP2 + VPP),
            "pp-params-reshard": _communication(rank, PARAMS + PP2 + VPP + RESHARD),
        }
    return out


@pytest.fixture(scope="module")
def results():
    references = run_distributed(1, _references)
    out = {("reference", model): ref for model, ref in zip(BOTH, references[0])}
    out.update({("reference", p): ref for p, ref in zip(PRECISIONS, references[0][len(BOTH) :])})
    for world in LAYOUTS:
        per_rank = run_distributed(world, world_checks, world)
        keys = [(name, model) for name, (_, models) in LAYOUTS[world].items() for model in models]
        keys += [("dp2-params", p) for p in PRECISIONS] if world == 2 else []
        for index, key in enumerate(keys):
            out[key] = [rank_out["runs"][index] for rank_out in per_rank]
        out[("communication", world)] = [rank_out.get("communication") for rank_out in per_rank]
    return out


@pytest.mark.parametrize("world,layout,model", CASES, ids=[f"{m}-{lay}" for _, lay, m in CASES])
def test_strategy_matches_one_process(results, world, layout, model):
    reference = results[("reference", model)]
    assert reference["grad_norms"][0] > 0.3, "clipping must be active"
    dp = world // ((2 if "tp2" in layout else 1) * (2 if "pp2" in layout else 1))  # dp x cp
    for rank, out in enumerate(results[(layout, model)]):
        assert_final_weights_match(rank, out, reference, LR)
        assert (out["weight_steps"] > 0) == ("split" in layout), f"rank {rank}: split backward's WEIGHT steps"
        params, grads = out["resident_bytes"]
        assert grads == 4 * out["padded"] // dp, f"rank {rank}: gradient bytes {grads}"
        assert params == 4 * out["padded"] // (dp if "params" in layout else 1), f"rank {rank}: parameter bytes"
        assert out["estimate"][:2] == (params, grads), f"rank {rank}: the estimator's bytes"
        if "offload" not in layout:  # (the offload split is checked in test_offload_optimizer.py)
            assert out["optimizer_bytes"] == 8 * out["padded"] // dp == out["estimate"][2]


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_low_precision_tracks_one_process(results, precision):
    """bf16 / fp16 weights, fp32 master weights and gradient shards: the one-process losses up to
    the low-precision rounding of another summation order (as tests/parallel/test_equivalence.py)."""
    reference = results[("reference", precision)]["losses"]
    for rank, out in enumerate(results[("dp2-params", precision)]):
        for it, (loss, expected) in enumerate(zip(out["losses"], reference), start=1):
            assert abs(loss - expected) <= 2e-3 * abs(expected), f"rank {rank} iteration {it}: {loss} vs {expected}"
        params, grads = out["resident_bytes"]
        assert (params, grads) == (2 * out["padded"] // 2, 4 * out["padded"] // 2)
        assert out["optimizer_bytes"] == 12 * out["padded"] // 2  # fp32 master + moments, over dp = 2
        assert out["estimate"] == (params, grads, out["optimizer_bytes"]), f"rank {rank}: the estimator's bytes"


def test_communication_is_the_analytic_volume(results):
    for rank, out in enumerate(results[("communication", 2)]):
        counts, padded, m, _ = out["grads"]
        assert m == 4
        assert counts["reduce_scatter_single"] == m * 4 * padded, f"rank {rank}: one reduce-scatter per microbatch"
        assert counts["all_gather_single"] == 4 * padded, f"rank {rank}: parameters gathered once, after the step"
        assert counts["all_reduce"] <= 64, f"rank {rank}: only scalars are all-reduced, got {counts}"
        counts, padded, m, (peak, buckets) = out["params"]
        assert counts["reduce_scatter_single"] == m * 4 * padded
        assert 0 < peak <= buckets // 4, f"rank {rank}: {peak} of {buckets} buckets gathered at once in forward"
        assert counts["all_gather_single"] == 2 * m * 4 * padded, f"rank {rank}: gathered for forward and backward"
        assert counts["all_reduce"] <= 64
        counts, padded, m, _ = out["grads-unsharded"]
        assert counts["reduce_scatter_single"] == 4 * padded, f"rank {rank}: accumulated unsharded, reduced once"
    for rank, out in enumerate(results[("communication", 4)]):
        counts, padded, m, _ = out["pp-params"]
        assert counts["reduce_scatter_single"] == m * 4 * padded
        assert counts["all_gather_single"] == 4 * padded, f"rank {rank}: under PP gathered once per step"
        counts, padded, m, (peak, buckets) = out["pp-params-reshard"]
        assert counts["reduce_scatter_single"] == m * 4 * padded
        assert counts["all_gather_single"] == 2 * m * 4 * padded, f"rank {rank}: --reshard-params-after-forward"
        assert 0 < peak < buckets, f"rank {rank}: {peak} of {buckets} buckets gathered at once in forward"


def save_and_resume(rank: int, root: str, flags: list[str], resumed: dict) -> dict:
    """Losses and grad norms of iterations 4-6: straight under `flags`, and resumed at 3 from a
    checkpoint saved under `flags` under each of `resumed` (name -> flags)."""
    straight = _steps(Trainer(_run("gpt", flags), torch.device("cpu")), 1, 6)
    stopped = Trainer(_run("gpt", flags), torch.device("cpu"))
    _steps(stopped, 1, 3)
    save_checkpoint(root, 3, stopped)
    out = {"straight": straight[3:]}
    for name, resumed_flags in resumed.items():
        run = _run("gpt", resumed_flags + ["--load", root])
        trainer = Trainer(run, torch.device("cpu"))
        iteration, _ = load_checkpoint(checkpoint_to_load(run), trainer, run.checkpoint)
        out[name] = _steps(trainer, iteration + 1, 6)
    return out


def test_checkpoint_resumes_under_another_strategy_and_layout(tmp_path):
    grads = run_distributed(2, save_and_resume, os.fspath(tmp_path / "grads"), GRADS, {"same": GRADS})
    assert all(out["same"] == out["straight"] for out in grads), "optim_grads: not bit for bit"
    resumed = {"same": PARAMS, "tp2-grads": GRADS + TP2}
    for rank, out in enumerate(run_distributed(2, save_and_resume, os.fspath(tmp_path / "params"), PARAMS, resumed)):
        assert out["same"] == out["straight"], f"rank {rank}: not bit for bit"
        for (loss, norm), (expected, expected_norm) in zip(out["tp2-grads"], out["straight"]):
            assert abs(loss - expected) <= 1e-5 * expected and abs(norm - expected_norm) <= 1e-5 * expected_norm


def test_cli_torchrun_optim_grads_params_matches_one_rank():
    two = torchrun_matching_one_rank("pretrain_llama.py", TINY_LLAMA, PARAMS, 2)
    assert "sharding strategy optim_grads_params: weights and gradients kept as shards over dp x cp = 2" in two.stdout


def _building_peak(rank: int) -> tuple[int, int, int]:
    """(most bytes of whole buckets alive at once while the trainer is built, the largest bucket's
    parameter + gradient bytes, the whole model's), under optim_grads_params."""
    live, peak, original = [], [0], TransientBuffer.__init__

    def counting(self, *args, **kwargs):
        original(self, *args, **kwargs)
        live.append(self)
        peak[0] = max(peak[0], sum(b.nbytes for b in live if b.allocated))

    TransientBuffer.__init__ = counting
    try:
        trainer = build_trainer("gpt", COMMON + PARAMS)
    finally:
        TransientBuffer.__init__ = original
    buckets = [b for chunk in trainer.chunks for b in chunk.buffer.buckets]
    largest = max(b.param_full.nbytes + b.grad_full.nbytes for b in buckets)
    return peak[0], largest, sum(b.param_full.nbytes + b.grad_full.nbytes for b in buckets)


def test_building_holds_one_whole_bucket_at_a_time():
    """Parameters are built holding no memory and initialised in their bucket, which keeps only
    the shard before the next bucket is made: building never holds the whole model."""
    for rank, (peak, largest, whole) in enumerate(run_distributed(2, _building_peak)):
        assert peak == largest < whole / 4, f"rank {rank}: {peak} bytes of whole buckets at once ({largest}, {whole})"
