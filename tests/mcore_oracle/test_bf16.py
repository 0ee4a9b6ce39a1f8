"""bf16 as megatron-core computes it: a resumed run's first iterations from the same weights.

megatron-core 0.16.1 (tests/mcore_oracle/driver.py, local layer spec, Float16Module, fp32 master
weights) trains the GPT-style and the Llama-style model of test_megatron_core.py in bf16 for 2
steps on one batch and saves a torch_dist checkpoint (bf16 weights, fp32 master weights and
moments), then records its logits and loss and 2 more steps. Ours loads that checkpoint with
--bf16 at tp 1 (dp 2) and tp 2: the logits, the loss, and steps 3-4's losses and grad norms are
megatron-core's within REL (relative; the logits within one bf16 rounding step in a few places at
most, see `_logits_close`).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import run_distributed
from tests.mcore_oracle.oracle import megatron_core_python, run_oracle
from tests.mcore_oracle.test_megatron_core import BATCH, SEQ, _job, _load, _logits_and_loss, _train

REL = 1e-6
MODELS = ("gpt", "llama")
LAYOUTS = ("tp1", "tp2")
BF16 = ["--bf16", "--attention-backend", "local"]


@pytest.fixture(scope="module")
def trained_by_megatron_core(tmp_path_factory):
    """Per model: megatron-core's bf16 checkpoint after 2 steps, its logits and loss there, steps 3-4."""
    megatron_core_python()
    directory = tmp_path_factory.mktemp("mcore_bf16")
    torch.manual_seed(0)
    tokens = torch.randint(0, 100, (BATCH, SEQ + 1))
    batch = str(directory / "batch.pt")
    torch.save({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}, batch)
    jobs = []
    for model in MODELS:
        out = directory / model
        out.mkdir()
        ops = [
            {"op": "train", "iters": 2, "out": str(out / "steps_1_2.json")},
            {"op": "save", "root": str(out / "trained"), "iteration": 2},
            {"op": "forward", "out": str(out / "logits.pt")},
            {"op": "train", "iters": 2, "out": str(out / "steps_3_4.json")},
        ]
        jobs.append(_job(model, 1, batch, ops) | {"bf16": True})
    run_oracle(jobs, directory)
    return directory, batch


def _ours(rank: int, directory: str, batch_file: str) -> dict:
    batch = torch.load(batch_file)
    results = {}
    for model in MODELS:
        for layout in LAYOUTS:
            trainer, iteration = _load(model, layout, f"{directory}/{model}/trained", batch, BF16)
            logits, loss = _logits_and_loss(trainer, batch)
            results[(model, layout)] = {"logits": logits, "loss": loss, "steps": _train(trainer, iteration + 1, 4)}
    return results


def relative_error(ours, theirs) -> float:
    ours, theirs = torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(theirs, dtype=torch.float64)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return ((ours - theirs).abs() / theirs.abs()).max().item()


def test_bf16_resumed_run_is_megatron_cores(trained_by_megatron_core):
    directory, batch_file = trained_by_megatron_core
    results = run_distributed(2, _ours, str(directory), batch_file)[-1]
    for model in MODELS:
        reference = torch.load(directory / model / "logits.pt")
        steps = json.loads((directory / model / "steps_3_4.json").read_text())
        for layout in LAYOUTS:
            ours, case = results[(model, layout)], f"bf16 {model} at {layout}"
            assert torch.equal(ours["logits"].float(), reference["logits"].float()), case + ": logits"
            assert relative_error(ours["loss"], reference["loss"]) <= REL, case + ": per-token loss"
            for key in ("loss", "grad_norm"):
                error = relative_error(ours["steps"][key], steps[key])
                assert error <= REL, (case + f": steps 3-4 {key}", error, ours["steps"][key], steps[key])
