"""Megatron's learning-rate and loss-scale timing, each a check that failed before the fix:
the first update uses the schedule's value at step 0, an fp16-skipped iteration does not
advance the schedule, the result carries the loss scale after the update; and
--decoupled-lr steps the embedding and output layer with their own learning rate."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.training.arguments.parser import parse_run_config
from megatron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.parallel.layouts import model_flags, named_params


def _trainer(model, extra):
    defaults, argv = model_flags(model, extra)
    return Trainer(parse_run_config(argv, defaults, dist.get_world_size()), torch.device("cpu"))


def _inject_inf_once(trainer):
    step = trainer.optimizer.step

    def poisoned():
        next(iter(named_params(trainer)))[1].main_grad.view(-1)[0] = float("inf")
        trainer.optimizer.step = step
        return step()

    trainer.optimizer.step = poisoned


def timing_checks(rank):
    # BASE: --lr 3e-3 --lr-warmup-iters 1 (8 samples) --lr-decay-style cosine, 5 iterations of 8 samples
    trainer = _trainer("gpt", ["--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1"])
    _inject_inf_once(trainer)
    first = trainer.train_step(1)
    used_lr = trainer.optimizer.adam.lr
    second_lr = trainer.learning_rates()[0]
    third = trainer.train_step(2)
    return {
        "first_lr": used_lr,
        "skipped": first.skipped,
        "scale_logged": first.loss_scale,
        "lr_after_skip": second_lr,
        "second_skipped": third.skipped,
        "lr_logged": third.lr,
        "schedule": [trainer.run.lr_schedule(n) for n in (0, 8, 16)],
    }


def decoupled_checks(rank):
    trainer = _trainer("llama", ["--lr-warmup-iters", "0", "--decoupled-lr", "0", "--decoupled-min-lr", "0"])
    before = {n: p.detach().clone() for n, p in named_params(trainer)}
    trainer.train_step(1)
    return {n: bool(torch.equal(before[n], p)) for n, p in named_params(trainer)}


@pytest.fixture(scope="module")
def results():
    return run_distributed(1, lambda rank: (timing_checks(rank), decoupled_checks(rank)))[0]


def test_first_update_uses_the_value_at_step_zero(results):
    timing, _ = results
    assert timing["first_lr"] == 0.0  # warm-up starts at --lr-warmup-init (0); before: lr x 1/1


def test_skipped_iteration_does_not_advance_the_schedule(results):
    timing, _ = results
    assert timing["skipped"] and timing["lr_after_skip"] == 0.0 and not timing["second_skipped"]
    assert timing["lr_logged"] == pytest.approx(timing["schedule"][1])  # after one successful update: 8 samples


def test_logged_loss_scale_is_the_one_after_the_update(results):
    timing, _ = results
    assert timing["scale_logged"] == 512.0  # halved by the skipped step; before: 1024, the one used


def test_decoupled_lr_applies_to_embedding_and_output_layer_only(results):
    _, unchanged = results
    decoupled = {"embedding.word_embeddings.weight", "output_layer.weight"}
    assert all(unchanged[n] for n in decoupled)
    assert not any(unchanged[n] for n in unchanged if n not in decoupled)
