"""bf16 as megatron-core computes it: a resumed run's first iterations from the same weights.

megatron-core 0.16.1 (tests/mcore_oracle/driver.py, local layer spec, Float16Module, fp32 master
weights) trains the GPT-style and the Llama-style model of test_megatron_core.py in bf16 at tp 2
(and the Llama at tp 1) for 2 steps on one batch (one microbatch) and saves a torch_dist
checkpoint (bf16 weights, fp32 master weights and moments), then records its logits and loss and
2 more steps. Ours loads each checkpoint with --bf16 --attention-backend local in a layout that
sums as it does (`CASES`), the batch as one microbatch: the logits and the per-token loss are
megatron-core's, and steps 3-4's losses and grad norms, within REL (relative; the logits relative
to their largest).

Megatron-LM's default configuration, both ways: megatron-core trains the GPT with 100 tokens and the
Llama with 120, each padded to 128 rows, in bf16 with its DistributedOptimizer at tp 1 x dp 2 (each dp
rank its own half of the batch) and saves torch_dist as Megatron-LM does (`dp_reshardable` buckets);
ours resumes it with --bf16 --use-distributed-optimizer --attention-backend local at dp 2 and gives
megatron-core's steps 3-4, then saves --ckpt-format torch_dist after step 4, and megatron-core resumes
ours with our steps 5-6: losses and grad norms within REL.

Megatron-LM's own resume, where it cannot match (issue 41): run on CPU (no apex, no Transformer Engine),
megatron-core's DistributedOptimizer.load_state_dict gives every parameter one shared `step` tensor, and
torch's AdamW, which counts steps per parameter, advances it once per parameter: in the first update after
a load the k-th parameter's bias corrections use step s + k instead of s + 1. The first resumed iteration's
loss (the loaded weights') is unchanged, the second's is not. Measured here: megatron-core's own resume
with that shared step against its uninterrupted run (step 3 equal; step 4 off), with a step per parameter
(equal), and without the distributed optimizer (its load copies the step per parameter: equal). Ours
resumes as the uninterrupted run does (above). With apex's or Transformer Engine's fused Adam (one step per
parameter group, on GPU) the shared tensor is never advanced per parameter.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron.core.pipeline_parallel.microbatch import Microbatch
from megatron.training.checkpoint.torch_dist import save_megatron_checkpoint
from tests.distributed import run_distributed
from tests.mcore_oracle.oracle import megatron_core_python, run_oracle
from tests.mcore_oracle.test_megatron_core import (
    BATCH,
    PADDED,
    PADDED_GPT,
    _job,
    _load,
    _logits_and_loss,
    _train,
    write_batch,
)

REL = 1e-6
# (model, our layout, megatron-core's tp that computes the same sums): at tp 1 its two dp ranks each
# take the whole batch, as our two pipeline stages do. Not the GPT at pp 2: the stages sum its tied
# embedding's two gradients in fp32 (as Megatron's pipeline does), one stage in bf16 (autograd).
CASES = (("gpt", "tp2", 2), ("llama", "tp2", 2), ("llama", "pp2", 1))
# one microbatch of the whole batch, as megatron-core's step takes it (in bf16, splitting the batch over
# microbatches or dp ranks rounds the weight gradients' partial sums differently)
# megatron-core runs without gradient accumulation fusion here (driver.py: its fused wgrad kernel is CUDA's):
# its autograd rounds each weight-gradient product to bf16 before main_grad adds it, as ours does without it
UNFUSED_WGRAD = ["--no-gradient-accumulation-fusion"]
BF16 = ["--bf16", "--attention-backend", "local", "--micro-batch-size", str(BATCH), *UNFUSED_WGRAD]
# Megatron-LM's default configuration: a padded vocabulary (the GPT's 100 tokens, the Llama's 120, in 128
# rows), bf16 and the distributed optimizer (its checkpoint in dp_reshardable buckets) at tp 1 x dp 2, each dp
# rank one microbatch of its own half of the batch (megatron-core's `dp_split`; ours: --micro-batch-size 1):
# both sum the dp ranks' bf16 weight gradients in fp32
DEFAULT_MODELS = (PADDED_GPT, PADDED)
DEFAULT_JOB = {"bf16": True, "distributed_optimizer": True, "dp_split": True}
DEFAULT = ["--bf16", "--attention-backend", "local", "--use-distributed-optimizer", *UNFUSED_WGRAD]


@pytest.fixture(scope="module")
def trained_by_megatron_core(tmp_path_factory):
    """Per model and tp: megatron-core's bf16 checkpoint after 2 steps, its logits and loss there, steps 3-4;
    per DEFAULT_MODELS model, the same in Megatron-LM's default configuration (no logits)."""
    megatron_core_python()
    directory = tmp_path_factory.mktemp("mcore_bf16")
    batch = write_batch(directory)
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
    for model in DEFAULT_MODELS:
        out = directory / f"default_{model}"
        out.mkdir()
        ops = [
            {"op": "train", "iters": 2, "out": str(out / "steps_1_2.json")},
            {"op": "save", "root": str(out / "trained"), "iteration": 2},
            {"op": "train", "iters": 2, "out": str(out / "steps_3_4.json")},
        ]
        jobs.append(_job(model, 1, batch, ops) | DEFAULT_JOB)
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


def _step_errors(case: str, ours: dict, theirs: dict, first: int) -> dict[str, float]:
    """The relative error of every step's loss and grad norm, ours against megatron-core's from step `first`."""
    errors = {}
    for key in ("loss", "grad_norm"):
        for i, (a, b) in enumerate(zip(ours[key], theirs[key], strict=True)):
            errors[case + f": step {first + i} {key}"] = relative_error(a, b)
    return errors


def _within_rel(errors: dict[str, float]) -> None:
    print("\n".join(f"{case}: {error:.2e}" for case, error in errors.items()))
    assert all(error <= REL for error in errors.values()), errors


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
        errors |= _step_errors(case, ours["steps"], steps, 3)
    _within_rel(errors)


def _ours_default(rank: int, directory: str, batch_file: str) -> dict:
    """Per model: steps 3-4 from megatron-core's checkpoint, a torch_dist save after step 4, steps 5-6."""
    batch = torch.load(batch_file)
    results = {}
    for model in DEFAULT_MODELS:
        trainer, iteration = _load(model, "tp1", f"{directory}/default_{model}/trained", batch, DEFAULT)
        results[model] = {"steps 3-4": _train(trainer, iteration + 1, 4)}
        save_megatron_checkpoint(f"{directory}/ours_default_{model}", 4, trainer)
        results[model]["steps 5-6"] = _train(trainer, 5, 6)
    return results


def test_megatron_lm_default_configuration_resumes_both_ways(trained_by_megatron_core):
    """Megatron-LM's default configuration (DEFAULT_JOB): megatron-core's checkpoint (bf16 weights, fp32
    master weights and moments in dp_reshardable buckets, padding rows) resumes in ours at dp 2 with its
    steps 3-4, and ours, saved with --ckpt-format torch_dist after step 4, in megatron-core with our
    steps 5-6, within REL."""
    directory, batch_file = trained_by_megatron_core
    results = run_distributed(2, _ours_default, str(directory), batch_file)[0]
    errors = {}
    for model in DEFAULT_MODELS:
        theirs = json.loads((directory / f"default_{model}" / "steps_3_4.json").read_text())
        errors |= _step_errors(f"{model}: megatron-core's save resumed by ours", results[model]["steps 3-4"], theirs, 3)
    _within_rel(errors)
    jobs = [
        _job(
            model,
            1,
            batch_file,
            [
                {"op": "load", "root": str(directory / f"ours_default_{model}"), "optimizer": True},
                {"op": "train", "iters": 2, "out": str(directory / f"ours_default_{model}_steps_5_6.json")},
            ],
        )
        | DEFAULT_JOB
        for model in DEFAULT_MODELS
    ]
    run_oracle(jobs, directory)
    errors = {}
    for model in DEFAULT_MODELS:
        theirs = json.loads((directory / f"ours_default_{model}_steps_5_6.json").read_text())
        errors |= _step_errors(f"{model}: our save resumed by megatron-core", results[model]["steps 5-6"], theirs, 5)
    _within_rel(errors)


def test_megatron_lms_own_resume_on_cpu_shares_one_step_across_parameters(trained_by_megatron_core):
    """Why Megatron-LM's own run (on CPU) and ours part at the second resumed iteration (module docstring):
    megatron-core resumes its checkpoints of steps 1-2 and trains steps 3-4, loading as Megatron-LM does
    (`shared_step`) and with a step per parameter, and its bf16 Llama without the distributed optimizer."""
    directory, batch_file = trained_by_megatron_core
    # (case, the uninterrupted run's directory, job keys)
    cases = [
        (f"{m} shared step {shared}", f"default_{m}", DEFAULT_JOB | {"shared_step": shared})
        for m in DEFAULT_MODELS
        for shared in (True, False)
    ]
    cases.append(("llama without the distributed optimizer", "llama_tp1", {"bf16": True}))
    jobs = []
    for i, (_, saved, keys) in enumerate(cases):
        model = saved.removeprefix("default_").removesuffix("_tp1")
        ops = [
            {"op": "load", "root": str(directory / saved / "trained"), "optimizer": True},
            {"op": "train", "iters": 2, "out": str(directory / f"megatron_lm_resume_{i}.json")},
        ]
        jobs.append(_job(model, 1, batch_file, ops) | keys)
    run_oracle(jobs, directory)
    for i, (case, saved, keys) in enumerate(cases):
        uninterrupted = json.loads((directory / saved / "steps_3_4.json").read_text())
        resumed = json.loads((directory / f"megatron_lm_resume_{i}.json").read_text())
        errors = _step_errors(case, resumed, uninterrupted, 3)
        print("\n".join(f"{name}: {error:.2e}" for name, error in errors.items()))
        for name, error in errors.items():
            shared_step_4 = keys.get("shared_step", False) and "step 4" in name  # the second resumed iteration
            assert error > REL if shared_step_4 else error == 0.0, (name, error)
