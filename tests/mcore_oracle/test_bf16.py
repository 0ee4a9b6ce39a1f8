"""bf16 as megatron-core computes it: a resumed run's first iterations from the same weights.

megatron-core 0.16.1 (tests/mcore_oracle/driver.py, local layer spec, Float16Module, fp32 master
weights) trains the GPT-style and the Llama-style model of test_megatron_core.py in bf16 at tp 2
(and the Llama at tp 1) for 2 steps on one batch (one microbatch) and saves a torch_dist
checkpoint (bf16 weights, fp32 master weights and moments), then records its logits and loss and
2 more steps. Ours loads each checkpoint with --bf16 --attention-backend local in a layout that
sums as it does (`CASES`), the batch as one microbatch: the logits and the per-token loss are
megatron-core's, and steps 3-4's losses and grad norms, within REL (relative; the logits relative
to their largest).
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron.core.pipeline_parallel.microbatch import Microbatch
from tests.distributed import run_distributed
from tests.mcore_oracle.oracle import megatron_core_python, run_oracle
from tests.mcore_oracle.test_megatron_core import BATCH, SEQ, _job, _load, _logits_and_loss, _train

REL = 1e-6
# (model, our layout, megatron-core's tp that computes the same sums): at tp 1 its two dp ranks each
# take the whole batch, as our two pipeline stages do. Not the GPT at pp 2: the stages sum its tied
# embedding's two gradients in fp32 (as Megatron's pipeline does), one stage in bf16 (autograd).
CASES = (("gpt", "tp2", 2), ("llama", "tp2", 2), ("llama", "pp2", 1))
# one microbatch of the whole batch, as megatron-core's step takes it (in bf16, splitting the batch over
# microbatches or dp ranks rounds the weight gradients' partial sums differently)
BF16 = ["--bf16", "--attention-backend", "local", "--micro-batch-size", str(BATCH)]


@pytest.fixture(scope="module")
def trained_by_megatron_core(tmp_path_factory):
    """Per model and tp: megatron-core's bf16 checkpoint after 2 steps, its logits and loss there, steps 3-4."""
    megatron_core_python()
    directory = tmp_path_factory.mktemp("mcore_bf16")
    torch.manual_seed(0)
    tokens = torch.randint(0, 100, (BATCH, SEQ + 1))
    batch = str(directory / "batch.pt")
    torch.save({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}, batch)
    jobs = []
    for model, _, tp in CASES:
        out = directory / f"{model}_tp{tp}"
        out.mkdir()
        ops = [
            {"op": "train", "iters": 2, "out": str(out / "steps_1_2.json")},
            {"op": "save", "root": str(out / "trained"), "iteration": 2},
            {"op": "forward", "out": str(out / "logits.pt")},
            {"op": "train", "iters": 2, "out": str(out / "steps_3_4.json")},
        ]
        jobs.append(_job(model, tp, batch, ops) | {"bf16": True})
    run_oracle(jobs, directory)
    return directory, batch


def _feed_whole(trainer, batch: dict) -> None:
    """Every iteration trains on `batch` as one microbatch."""
    whole = Microbatch(batch["tokens"], batch["labels"], torch.ones_like(batch["tokens"], dtype=torch.float))
    trainer.batch_fn = lambda iteration: lambda m: whole


def _ours(rank: int, directory: str, batch_file: str) -> dict:
    batch = torch.load(batch_file)
    results = {}
    for model, layout, tp in CASES:
        trainer, iteration = _load(model, layout, f"{directory}/{model}_tp{tp}/trained", batch, BF16)
        _feed_whole(trainer, batch)
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
    errors = {}
    for model, layout, tp in CASES:
        saved = directory / f"{model}_tp{tp}"
        reference = torch.load(saved / "logits.pt")
        steps = json.loads((saved / "steps_3_4.json").read_text())
        ours, case = results[(model, layout)], f"bf16 {model} at {layout} (megatron-core at tp{tp})"
        logits, theirs = ours["logits"].double(), reference["logits"].double()
        errors[case + ": logits"] = ((logits - theirs).abs().max() / theirs.abs().max()).item()
        errors[case + ": per-token loss"] = relative_error(ours["loss"], reference["loss"])
        for key in ("loss", "grad_norm"):
            for i, (a, b) in enumerate(zip(ours["steps"][key], steps[key])):
                errors[case + f": step {3 + i} {key}"] = relative_error(a, b)
    print("\n".join(f"{case}: {error:.2e}" for case, error in errors.items()))
    assert all(error <= REL for error in errors.values()), errors
