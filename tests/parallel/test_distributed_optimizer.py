"""The distributed optimizer (--use-distributed-optimizer) reproduces the replicated one.

Layouts DP=1, DP=2, DP=4, TP=2 (+SP) x DP=2, PP=2 (v=2) x DP=2 and TP=2 x PP=2 (v=2) x DP=2 on 8
ranks, GPT (tied embeddings, biases) and Llama, fp32, several microbatches, clipping active and
buckets small enough that parameters straddle shards: the lm loss of 5 iterations, the
iteration-1 grad norm and the parameters after 5 steps match the one-process replicated run. Each
rank's optimizer state, counted from the tensors, is 8/(dp cp) bytes per parameter (12 with bf16)
plus bucket padding, and within that padding of the memory estimator's figure. fp16 with an inf
injected into one rank's shard skips the step on every rank with parameters and moments unchanged.
Weight decay spares biases and norm weights (checked against the owning module's kind) in both
optimizers. The bytes communicated per step are the reduce-scatter + all-gather volume, with no
gradient all-reduce. torchrun with 4 ranks prints the one-rank losses and the sharded state bytes.
"""

from __future__ import annotations

import pytest
import torch

from megatron.core.distributed.bucket_layout import SHARD_ALIGN
from megatron.core.transformer.norm import Norm
from megatron.planning.estimator import estimate_memory
from megatron.training.memory_check import layout_from_run
from tests.cli import TINY_LLAMA, torchrun_matching_one_rank
from tests.distributed import run_distributed
from tests.parallel.layouts import assert_final_weights_match, named_params, train
from tests.parallel.layouts import build_trainer as _trainer
from tools.bench.distributed_optimizer import count_collectives

DIST = ["--use-distributed-optimizer"]
LR = 3e-3  # layouts.BASE
# 8 microbatches in one process, 2-4 per dp rank; the grad norm (~1) is clipped to 0.3; buckets of
# ~700 elements, so many parameters straddle two ranks' shards
COMMON = ["--global-batch-size", "16", "--clip-grad", "0.3", "--ddp-bucket-size", "700"]
TP2, SP, PP2, VPP = (
    ["--tensor-model-parallel-size", "2"],
    ["--sequence-parallel"],
    ["--pipeline-model-parallel-size", "2"],
    ["--num-layers-per-virtual-pipeline-stage", "1"],
)
GATHER = ["--overlap-param-gather"]
LAYOUTS = {
    1: {"dp1": DIST},
    2: {"dp2": DIST + GATHER},
    4: {
        "dp4": DIST,
        "tp2-sp-dp2": DIST + TP2 + SP + GATHER,
        "pp2-vpp2-dp2": DIST + PP2 + VPP + GATHER,
        "cp2-dp2": DIST + ["--context-parallel-size", "2"] + GATHER,
        "pp2-vpp2-dp2-split": DIST + PP2 + VPP + GATHER + ["--split-backward"],
    },
    8: {"tp2-sp-pp2-vpp2-dp2": DIST + TP2 + SP + PP2 + VPP + GATHER},
}
MODELS = ("gpt", "llama")
CASES = [(world, name, model) for world, layouts in LAYOUTS.items() for name in layouts for model in MODELS]


def train_and_count(rank: int, runs: list) -> list[dict]:
    """Train each run; add what the state bytes are checked against: parameters and padded buffer
    elements on this rank, buckets, and the estimator's optimizer figure for this rank."""
    out = []
    for model, flags in runs:
        result = train(model, flags)
        trainer = _trainer(model, flags)
        run = trainer.run
        estimate = estimate_memory(
            run.model, layout_from_run(run, "cpu", distributed_optimizer="--use-distributed-optimizer" in flags)
        )
        buffers = [chunk.buffer for chunk in trainer.chunks]
        result.update(
            params=trainer.parameters_on_rank(),
            padded=sum(b.layout.numel for b in buffers),
            buckets=sum(len(b.buckets) for b in buffers),
            estimate=estimate.ranks[trainer.mesh.pp_rank].optimizer_bytes,
        )
        out.append(result)
    return out


@pytest.fixture(scope="module")
def results():
    out = {}
    for world, layouts in [(1, {"reference": []})] + list(LAYOUTS.items()):
        runs = [(model, COMMON + flags) for flags in layouts.values() for model in MODELS]
        per_rank = run_distributed(world, train_and_count, runs)
        for index, key in enumerate((n, m) for n in layouts for m in MODELS):
            out[key] = [rank_results[index] for rank_results in per_rank]
    return out


@pytest.mark.parametrize("world,layout,model", CASES, ids=[f"{model}-{layout}" for _, layout, model in CASES])
def test_distributed_optimizer_matches_one_process(results, world, layout, model):
    reference = results[("reference", model)][0]
    assert reference["grad_norms"][0] > 0.3, "clipping must be active"
    dp = world // ((2 if "tp2" in layout else 1) * (2 if "pp2" in layout else 1))
    for rank, out in enumerate(results[(layout, model)]):
        assert_final_weights_match(rank, out, reference, LR)
        # fp32 weights are their own master: Adam's m and v, 8 bytes per padded element / dp
        assert out["optimizer_bytes"] == 8 * out["padded"] // dp, f"rank {rank}"
        assert 0 <= out["padded"] - out["params"] < out["buckets"] * dp * SHARD_ALIGN or dp == 1
        assert out["estimate"] <= out["optimizer_bytes"] <= out["estimate"] + 8 * out["buckets"] * SHARD_ALIGN, (
            f"rank {rank}: measured {out['optimizer_bytes']} vs estimate {out['estimate']}"
        )


def _moments(trainer) -> list[torch.Tensor]:
    adam = trainer.optimizer.adam
    return [t.clone() for t in adam.exp_avg + adam.exp_avg_sq + [s.main for s in adam.shards]]


def check_fp16_inf_skips_everywhere(rank: int, flags: list[str] = DIST) -> None:
    trainer = _trainer("gpt", flags + ["--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1"])
    assert not trainer.train_step(1).skipped
    trainer.optimizer.finish_param_sync()  # sharded parameters (optim_grads_params) made whole to be read
    before, moments = {n: p.detach().clone() for n, p in named_params(trainer)}, _moments(trainer)
    trainer.forward_backward(2)
    if rank == 0:  # only this rank's shard sees it
        trainer.optimizer.shards[0].grad[0] = float("inf")
    result = trainer.optimizer.step()
    trainer.optimizer.finish_param_sync()
    assert result.skipped and trainer.optimizer.loss_scale == 512.0, f"rank {rank} did not skip"
    assert all(torch.equal(before[n], p) for n, p in named_params(trainer)), "a skipped step changed weights"
    assert all(torch.equal(a, b) for a, b in zip(moments, _moments(trainer))), "a skipped step changed state"
    assert not trainer.train_step(3).skipped


def check_weight_decay_by_kind(flags: list[str]) -> None:
    """Zero gradients: Adam's update is 0, so a step only applies decoupled weight decay."""
    trainer = _trainer(
        "gpt",
        flags + ["--lr", "0.1", "--weight-decay", "0.5", "--lr-warmup-iters", "0", "--lr-decay-style", "constant"],
    )
    before = {n: p.detach().clone() for n, p in named_params(trainer)}
    for chunk in trainer.chunks:
        chunk.zero_grad_buffer()
    trainer.optimizer.step()
    trainer.optimizer.finish_param_sync()
    for chunk in trainer.chunks:
        for module_name, module in chunk.module.named_modules():
            for leaf, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{leaf}" if module_name else leaf
                exempt = leaf == "bias" or isinstance(module, Norm)
                expected = before[name] if exempt else before[name] * (1 - 0.1 * 0.5)
                torch.testing.assert_close(param.detach(), expected, msg=f"{flags} {name}")


def check_bf16_state_bytes(rank: int) -> None:
    trainer = _trainer("llama", DIST + ["--bf16"])
    trainer.train_step(1)
    padded = sum(chunk.buffer.layout.numel for chunk in trainer.chunks)
    assert trainer.optimizer.state_bytes() == 12 * padded // 2  # master + m + v, fp32, over dp = 2


def check_communication(rank: int) -> dict:
    """Bytes per collective kind in one step after the first, with and without the flag."""
    out = {}
    for name, flags in (("replicated", []), ("distributed", DIST)):
        trainer = _trainer("gpt", flags)
        trainer.train_step(1)
        with count_collectives() as counts:
            trainer.train_step(2)
            trainer.optimizer.finish_param_sync()
        buffer = trainer.chunks[0].buffer
        out[name] = (counts, buffer.grad_data.numel() * 4, buffer.param_data.numel() * 4)
    return out


def world2_checks(rank: int) -> dict:
    check_fp16_inf_skips_everywhere(rank)
    check_weight_decay_by_kind([])
    check_weight_decay_by_kind(DIST)
    check_bf16_state_bytes(rank)
    return check_communication(rank)


def test_fp16_skip_weight_decay_state_bytes_and_communication():
    for rank, out in enumerate(run_distributed(2, world2_checks)):
        counts, grad_bytes, param_bytes = out["replicated"]
        assert counts.get("reduce_scatter_single", 0) == counts.get("all_gather_single", 0) == 0
        assert grad_bytes <= counts["all_reduce"] <= grad_bytes + 64  # + the loss and norm scalars
        counts, grad_bytes, param_bytes = out["distributed"]
        assert counts["reduce_scatter_single"] == grad_bytes and counts["all_gather_single"] == param_bytes
        assert counts["all_reduce"] <= 64, f"rank {rank}: only scalars are all-reduced, got {counts}"


def test_cli_torchrun_distributed_optimizer_matches_one_rank():
    four = torchrun_matching_one_rank(
        "pretrain_llama.py", TINY_LLAMA, DIST + ["--overlap-grad-reduce", "--overlap-param-gather"], 4
    )
    assert "optimizer state per rank (rank order, bytes, sharded over dp x cp = 4)" in four.stdout
