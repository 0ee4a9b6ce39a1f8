"""The loss is the exact global mean over unmasked tokens in every layout (masked tokens and
fully masked microbatches included), and dropout trains and replays under a composed layout."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.training.arguments.parser import parse_run_config
from megatron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.parallel.layouts import model_flags, named_params, seed_key, train

TP2_PP2 = [
    "--tensor-model-parallel-size",
    "2",
    "--sequence-parallel",
    "--pipeline-model-parallel-size",
    "2",
    "--num-layers-per-virtual-pipeline-stage",
    "1",
]
FUSED_TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--cross-entropy-loss-fusion"]
MASKED_LAYOUTS = {1: [[]], 2: [[], FUSED_TP2_SP], 4: [TP2_PP2, ["--pipeline-model-parallel-size", "2"]]}


class MaskedDataset:
    """Mock samples with a loss mask that depends only on the sample index: samples 0 and 1
    (microbatch 0 of iteration 1 at dp 1) are fully masked, the others lose every third token."""

    def __init__(self, inner):
        self.inner = inner

    def __getitem__(self, index):
        sample = dict(self.inner[index])
        positions = torch.arange(sample["loss_mask"].numel())
        keep = torch.zeros_like(positions, dtype=torch.bool) if index < 2 else (positions + index) % 3 != 0
        sample["loss_mask"] = keep.float()
        return sample


def masked_run(rank, layouts):
    out = []
    for extra in layouts:
        defaults, argv = model_flags("llama", extra)
        trainer = Trainer(parse_run_config(argv, defaults, dist.get_world_size()), torch.device("cpu"))
        trainer.dataset = MaskedDataset(trainer.dataset)
        loss, *_ = trainer.forward_backward(1)
        grads = {seed_key(n, p): (p.main_grad.clone(), p.init_spec) for n, p in named_params(trainer)}
        out.append({"loss": loss, "grads": grads, "direct": _direct(trainer) if dist.get_world_size() == 1 else None})
    return out


def _direct(trainer) -> tuple[float, dict]:
    """sum(masked token losses) / sum(mask) over the global batch in one forward, and its gradients."""
    samples = [trainer.dataset[i] for i in range(trainer.run.training.global_batch_size)]
    tokens, labels, mask = (torch.stack([s[k] for s in samples]) for k in ("tokens", "labels", "loss_mask"))
    chunk = trainer.chunks[0]
    chunk.zero_grad_buffer()
    loss = (chunk(tokens, labels) * mask).sum() / mask.sum()
    loss.backward()
    return loss.item(), {n: p.main_grad.clone() for n, p in chunk.module.named_parameters()}


def test_masked_loss_is_the_global_token_mean_in_every_layout():
    results = {world: run_distributed(world, masked_run, layouts) for world, layouts in MASKED_LAYOUTS.items()}
    reference = results[1][0][0]
    direct_loss, direct_grads = reference["direct"]
    assert abs(reference["loss"] - direct_loss) <= 1e-6 * direct_loss
    for name, grad in direct_grads.items():
        assert torch.allclose(reference["grads"][name][0], grad, rtol=1e-5, atol=1e-8), name
    for world, per_rank in results.items():
        for index in range(len(MASKED_LAYOUTS[world])):
            for rank, runs in enumerate(per_rank):
                run = runs[index]
                assert abs(run["loss"] - reference["loss"]) <= 1e-5 * reference["loss"], (world, index, rank)
                for name, (grad, spec) in run["grads"].items():
                    expected = reference["grads"][name][0]
                    if tuple(expected.shape) != tuple(spec.full_shape):
                        expected = torch.cat(
                            [
                                expected,
                                expected.new_zeros(
                                    (spec.full_shape[0] - expected.shape[0],) + tuple(expected.shape[1:])
                                ),
                            ]
                        )
                    expected = spec.shard.shard(expected) if spec.shard is not None else expected
                    error = (grad - expected).norm() / expected.norm().clamp_min(1e-12)
                    assert error <= 1e-5, (world, index, rank, name)


def dropout_runs(rank):
    """GPT (attention and hidden dropout 0.1) on TP2+SP x PP2 with two virtual stages."""
    dropout = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1", "--train-iters", "8"]
    plain = train("gpt", TP2_PP2 + dropout, iterations=8)
    recomputed = train(
        "gpt",
        TP2_PP2
        + dropout
        + ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
        iterations=8,
    )
    no_dropout = train("gpt", TP2_PP2 + ["--train-iters", "8"], iterations=2)
    return plain, recomputed, no_dropout


def test_dropout_trains_and_replays_under_a_composed_layout():
    for rank, (plain, recomputed, no_dropout) in enumerate(run_distributed(4, dropout_runs)):
        losses = plain["losses"]
        assert all(torch.isfinite(torch.tensor(losses))), losses
        assert sum(losses[-3:]) / 3 < losses[0], f"rank {rank}: loss did not fall with dropout: {losses}"
        assert plain["losses"][0] != no_dropout["losses"][0], "dropout must change the loss"
        assert recomputed["losses"] == plain["losses"], f"rank {rank}: recomputation must replay dropout masks"
        for name, (grad, _) in plain["grads"].items():
            assert torch.equal(recomputed["grads"][name][0], grad), f"rank {rank} {name}"
