"""Megatron-LM's torch_dist checkpoints of MoE models in and out, checked against megatron-core itself.

megatron-core 0.16.1 (tests/mcore_oracle/driver.py, two gloo ranks) trains two Llama-style MoE GPTModels (local
spec, SequentialMLP experts) for 2 steps at expert-parallel size 2 and at 1 (dp 2), saves torch_dist with its
(non-distributed) optimizer and trains 3 more steps: a Mixtral-like one (every layer MoE: stacked layers, experts
stacked by global index) and a DeepSeek-like one (a dense first layer, so one tensor per layer; a shared expert,
sigmoid routing with the expert bias and its per-iteration update, group-limited top-4). At EP2 megatron-core
keeps two optimizers (dense and expert-parallel parameters: a ChainedOptimizer, whose state names start with
`chained_0.` and `chained_1.`). No auxiliary loss: its per-microbatch statistics would differ between layouts
that split the batch differently. We load each checkpoint at EP2 (2 ranks) and on 1 rank (there with grouped
experts, --moe-grouped-gemm, whose torch_dist names are SequentialMLP's): steps 3-5 give megatron-core's losses
and grad norms. Both our runs then save torch_dist after step 5 and take steps 6-7; megatron-core loads each
save at the expert-parallel size it was written at (Megatron-LM's own optimizer state names change with it: one
optimizer at EP1, two at EP2) and its steps 6-7 are ours. All within 1e-5.
"""

from __future__ import annotations

import json
import os

import torch

from megatron.core.transformer.model_fields import MODEL_FIELDS, model_record
from megatron.training.checkpoint.torch_dist import save_megatron_checkpoint
from tests.distributed import run_distributed
from tests.mcore_oracle.oracle import megatron_core_python, run_oracle
from tests.mcore_oracle.test_megatron_core import _close, _job, _load, _run, _train, write_batch
from tests.mcore_oracle.test_moe_training import DEEPSEEK, MIXTRAL, RECORDED, TRAINING_ONLY

AUX_LOSS = ("--moe-aux-loss-coeff", "--moe-z-loss-coeff", "--moe-router-load-balancing-type")


def _without_aux_loss(flags: list[str]) -> list[str]:
    """`flags` less the auxiliary losses' flags and their values."""
    dropped = {i + j for i, flag in enumerate(flags) if flag in AUX_LOSS for j in (0, 1)}
    return [word for i, word in enumerate(flags) if i not in dropped]


CASES = {name: _without_aux_loss(flags) for name, flags in (("mixtral", MIXTRAL), ("deepseek", DEEPSEEK))}
EP = {1: [], 2: ["--expert-model-parallel-size", "2"]}
OUR_WORLD = {2: 2, 1: 1}  # our expert-parallel size -> ranks (EP2 on 2 ranks; EP1 on 1 rank)
OUR_EXPERTS = {2: [], 1: ["--moe-grouped-gemm"]}  # the expert loop at EP2, grouped experts at EP1


def _moe_job(case: str, ep: int, batch: str, ops: list[dict]) -> dict:
    config = _run("llama", CASES[case], 1).model
    megatron_lm_args = {f.megatron_arg: getattr(config, f.name) for f in MODEL_FIELDS if "moe" in f.name}
    return _job("llama", 1, batch, ops) | {
        "model": model_record(config),
        "ep": ep,
        "moe": {k: getattr(config, k) for k in RECORDED + TRAINING_ONLY},
        "moe_args": megatron_lm_args,
    }


def _compare(ours: dict, theirs: dict, what: str) -> None:
    """Losses and grad norms within 1e-5."""
    for key in ("loss", "grad_norm"):
        print(f"{what} {key}: max abs diff {max(abs(a - b) for a, b in zip(ours[key], theirs[key])):.2e}")
        _close(ours[key], theirs[key], f"{what} {key}")


def _ours(rank: int, directory: str, batch_file: str, ep: int) -> dict:
    """Steps 3-5 from each megatron-core checkpoint at expert-parallel size `ep`, then (from the EP2 one) our
    torch_dist save after step 5 and steps 6-7."""
    batch = torch.load(batch_file)
    results = {}
    for case, flags in CASES.items():
        for saved_ep in EP:
            root = os.path.join(directory, f"mcore_{case}_ep{saved_ep}")
            trainer, iteration = _load("llama", "tp1", root, batch, flags + EP[ep] + OUR_EXPERTS[ep])
            results[(case, saved_ep)] = _train(trainer, iteration + 1, 5)
        save_megatron_checkpoint(os.path.join(directory, f"ours_{case}_ep{ep}"), 5, trainer)
        results[(case, "steps 6-7")] = _train(trainer, 6, 7)
    return results


def test_megatron_core_moe_checkpoints_load_in_our_layouts_and_ours_in_megatron_core(tmp_path):
    megatron_core_python()
    batch = write_batch(tmp_path)
    jobs = [
        _moe_job(
            case,
            ep,
            batch,
            [
                {"op": "train", "iters": 2, "out": str(tmp_path / f"mcore_{case}_ep{ep}_steps_1_2.json")},
                {"op": "save", "root": str(tmp_path / f"mcore_{case}_ep{ep}"), "iteration": 2},
                {"op": "train", "iters": 3, "out": str(tmp_path / f"mcore_{case}_ep{ep}_steps_3_5.json")},
            ],
        )
        for case in CASES
        for ep in EP
    ]
    run_oracle(jobs, tmp_path)
    ours = {ep: run_distributed(world, _ours, str(tmp_path), batch, ep)[0] for ep, world in OUR_WORLD.items()}
    for case in CASES:
        for saved_ep in EP:
            theirs = json.loads((tmp_path / f"mcore_{case}_ep{saved_ep}_steps_3_5.json").read_text())
            for ep in OUR_WORLD:
                what = f"{case} saved by megatron-core at EP{saved_ep}, loaded at our EP{ep}: steps 3-5"
                _compare(ours[ep][(case, saved_ep)], theirs, what)
    jobs = [  # megatron-core reads its optimizer state at the expert-parallel size it was saved at (below)
        _moe_job(
            case,
            ep,
            batch,
            [
                {"op": "load", "root": str(tmp_path / f"ours_{case}_ep{ep}"), "optimizer": True},
                {"op": "train", "iters": 2, "out": str(tmp_path / f"ours_{case}_ep{ep}_in_mcore.json")},
            ],
        )
        for case in CASES
        for ep in OUR_WORLD
    ]
    run_oracle(jobs, tmp_path)
    for case in CASES:
        for ep in OUR_WORLD:
            theirs = json.loads((tmp_path / f"ours_{case}_ep{ep}_in_mcore.json").read_text())
            what = f"{case} saved by us at EP{ep}, loaded by megatron-core at EP{ep}: steps 6-7"
            _compare(ours[ep][(case, "steps 6-7")], theirs, what)
