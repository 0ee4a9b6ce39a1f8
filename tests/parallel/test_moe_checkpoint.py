"""MoE checkpoints reshard across expert-parallel layouts.

A DeepSeek-like model (expert bias, whose state lives outside the optimizer, shared expert, sigmoid group-limited
routing) trains 3 iterations at EP2 x DP2 with the alltoall dispatcher and the distributed optimizer, saves, and
continues iterations 4-6 at EP4 (the expert loop, and grouped experts), at EP2 (2 ranks, distributed optimizer,
grouped experts) and on one rank: the losses and grad norms of the uninterrupted one-rank run, within 1e-5 (expert
weights, their Adam moments and the expert bias are stored by global expert index, so any ep loads them; grouped
experts store theirs as the loop's per-expert tensors). The saving run uses grouped experts, so each kind reads the
other's checkpoint.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron.training.arguments.parser import parse_run_config
from megatron.training.checkpoint import checkpoint_to_load, load_checkpoint, save_checkpoint
from megatron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.parallel.layouts import model_flags
from tests.parallel.test_moe_equivalence import DEEPSEEK

EP = "--expert-model-parallel-size"
GROUPED = "--moe-grouped-gemm"
SAVED = [EP, "2", "--moe-token-dispatcher-type", "alltoall", "--use-distributed-optimizer", GROUPED]
CONTINUED = {4: [[EP, "4"], [EP, "4", GROUPED]], 2: [[EP, "2", "--use-distributed-optimizer", GROUPED]], 1: [[]]}


def _run(extra: list[str]):
    defaults, argv = model_flags("llama", ["--train-iters", "6"] + DEEPSEEK + extra)
    return parse_run_config(argv, defaults, dist.get_world_size())


def _steps(trainer: Trainer, first: int, last: int) -> list[tuple[float, float]]:
    return [(r.loss, r.grad_norm) for r in (trainer.train_step(i) for i in range(first, last + 1))]


def _continue(rank: int, root: str, layouts: list, save: bool) -> list:
    if save:
        trainer = Trainer(_run(SAVED), torch.device("cpu"))
        _steps(trainer, 1, 3)
        save_checkpoint(root, 3, trainer)
    out = []
    for layout in layouts:
        run = _run(layout + ["--load", root])
        trainer = Trainer(run, torch.device("cpu"))
        iteration, _ = load_checkpoint(checkpoint_to_load(run), trainer, run.checkpoint)
        out.append(_steps(trainer, iteration + 1, 6))
    return out


def _straight(rank: int) -> list:
    return _steps(Trainer(_run([]), torch.device("cpu")), 1, 6)[3:]


def test_moe_checkpoint_reshards_across_expert_parallel_sizes(tmp_path):
    root = os.path.join(str(tmp_path), "ckpt")
    reference = torch.tensor(run_distributed(1, _straight)[0], dtype=torch.float64)
    for world, layouts in CONTINUED.items():
        resumed = run_distributed(world, _continue, root, layouts, world == 4)[0]
        for layout, steps in zip(layouts, resumed):
            torch.testing.assert_close(
                torch.tensor(steps, dtype=torch.float64),
                reference,
                rtol=1e-5,
                atol=0,
                msg=lambda m, layout=layout: f"{layout}: {m}",
            )
