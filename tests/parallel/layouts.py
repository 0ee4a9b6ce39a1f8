"""Tiny GPT and Llama runs under any layout, returning what equivalence tests compare."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.training.arguments import GPT_DEFAULTS, LLAMA_DEFAULTS, parse_run_config
from megatron.training.training import Trainer

BASE = ["--num-layers", "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "5", "--mock-data", "--vocab-size", "100", "--lr", "3e-3", "--lr-warmup-iters", "1",
        "--lr-decay-style", "cosine", "--attention-dropout", "0", "--hidden-dropout", "0"]
MODELS = {
    "gpt": (GPT_DEFAULTS, ["--hidden-size", "32", "--num-attention-heads", "4"]),
    "llama": (LLAMA_DEFAULTS, ["--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention",
                               "--num-query-groups", "4", "--ffn-hidden-size", "96"]),
}


def model_flags(model: str, extra: list[str]) -> tuple[dict, list[str]]:
    defaults, flags = MODELS[model]
    return defaults, BASE + flags + list(extra)


def named_params(trainer: Trainer):
    for chunk in trainer.chunks:
        yield from chunk.module.named_parameters()


def seed_key(name: str, param) -> str:
    """The name under which the one-process model holds this parameter (tied copies map to the embedding)."""
    return param.init_spec.seed_name or name


def build_trainer(model: str, extra: list[str]) -> Trainer:
    defaults, argv = model_flags(model, extra)
    return Trainer(parse_run_config(argv, defaults, dist.get_world_size()), torch.device("cpu"))


def train(model: str, extra: list[str], iterations: int = 5, grads_at: int = 1) -> dict:
    """Train on this rank; return losses and grad norms per iteration, initial weights, gradients of
    iteration `grads_at` (whole only with the replicated optimizer: the distributed one keeps just
    this rank's shard of each reduced gradient), the weights after the last step and the bytes of
    optimizer state."""
    trainer = build_trainer(model, extra)
    initial = {seed_key(n, p): (p.detach().clone(), p.init_spec) for n, p in named_params(trainer)}
    losses, grads, grad_norms = [], {}, []
    for iteration in range(1, iterations + 1):
        loss, *_ = trainer.forward_backward(iteration)
        if iteration == grads_at:
            grads = {seed_key(n, p): (p.main_grad.clone(), p.init_spec) for n, p in named_params(trainer)}
        grad_norms.append(trainer.optimizer.step().grad_norm)
        losses.append(loss)
    trainer.optimizer.finish_param_sync()
    final = {seed_key(n, p): (p.detach().clone(), p.init_spec) for n, p in named_params(trainer)}
    return {"losses": losses, "initial": initial, "grads": grads, "grad_norms": grad_norms, "final": final,
            "optimizer_bytes": trainer.optimizer.state_bytes()}


def train_many(rank: int, runs: list[tuple[str, list[str]]]) -> list[dict]:
    return [train(model, extra) for model, extra in runs]
