"""Megatron-LM's torch_dist checkpoints in and out, checked against megatron-core itself.

megatron-core 0.16.1 (its own environment, tests/mcore_oracle/driver.py) builds a GPT-style
(LayerNorm, learned positions, GELU, biases, tied) and a Llama-style (RMSNorm, RoPE, SwiGLU, GQA,
untied) GPTModel at tp 1 and tp 2, saves it before training and again after 2 steps of its own
optimizer (AdamW, clipping, warm-up + cosine), and records its logits and 5 steps on one batch.
We load those checkpoints at tp 1 (dp 2), tp 2 and pp 2: the same logits and loss (and, at tp 1
and tp 2, the same gradients of the vocabulary tensors, padding rows included); 5 steps from
the untrained checkpoint, and steps 3-5 from the one with optimizer state, give megatron-core's
losses and grad norms. Then ours saves --ckpt-format torch_dist (the Llama from tp 2, the tied GPT
from two pipeline stages) and megatron-core loads it at tp 1 and tp 2: the same logits and loss,
and its next two training steps (the second after an update with the loaded optimizer state) the
losses and grad norms of ours. All within 1e-5.

The GPT and the first Llama (128 tokens) need no vocabulary padding. A third model, the Llama
with 120 tokens, is padded to 128 rows at tp 1 and tp 2 (--make-vocab-size-divisible-by 64): its
8 padding rows are initialised, take part in the softmax and are trained in megatron-core as in
ours, and it goes through everything the others do (logits over the real vocabulary, loss, 5 steps
from the same initial weights, steps 3-5 after a resume) and is the Llama ours saves for
megatron-core, padding rows trained. Last, our fresh run of it (our initialisation, padding rows
included) saved before its first step: megatron-core's 5 steps from those weights are ours.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel.microbatch import Microbatch
from megatron.core.transformer.model_fields import model_record
from megatron.training.arguments.parser import GPT_DEFAULTS, LLAMA_DEFAULTS, parse_run_config
from megatron.training.checkpoint import checkpoint_to_load, load_checkpoint
from megatron.training.checkpoint.torch_dist import save_megatron_checkpoint
from megatron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.mcore_oracle.oracle import megatron_core_python, run_oracle

TOL = 1e-5
BATCH, SEQ = 2, 16
COMMON = [
    "--num-layers",
    "2",
    "--seq-length",
    str(SEQ),
    "--max-position-embeddings",
    str(SEQ),
    "--make-vocab-size-divisible-by",
    "64",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    str(BATCH),
    "--train-iters",
    "10",
    "--mock-data",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-warmup-iters",
    "2",
    "--lr-decay-iters",
    "10",
    "--lr-decay-style",
    "cosine",
    "--weight-decay",
    "0.01",
    "--clip-grad",
    "1.0",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]
MODELS = {
    "gpt": (GPT_DEFAULTS, ["--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "128"]),
    "llama": (
        LLAMA_DEFAULTS,
        [
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--ffn-hidden-size",
            "64",
            "--vocab-size",
            "128",
        ],
    ),
}
PADDED = "llama_vocab_120"
MODELS[PADDED] = (LLAMA_DEFAULTS, MODELS["llama"][1][:-1] + ["120"])
PADDED_GPT = "gpt_vocab_100"  # the tied GPT with 100 tokens in 128 rows (tests/mcore_oracle/test_bf16.py)
MODELS[PADDED_GPT] = (GPT_DEFAULTS, MODELS["gpt"][1][:-1] + ["100"])
TRAINED = ("gpt", "llama", PADDED)
LAYOUTS = {"tp1": [], "tp2": ["--tensor-model-parallel-size", "2"], "pp2": ["--pipeline-model-parallel-size", "2"]}
# (model, saved tp, our layout) whose state after step 5 we save as torch_dist: the tied GPT from two
# pipeline stages, the Llama from two tp ranks
SAVED_BY_US = (("gpt", 1, "pp2"), (PADDED, 2, "tp2"))
OPTIMIZER = {
    "lr": 1e-3,
    "min_lr": 1e-4,
    "warmup_iters": 2,
    "decay_iters": 10,
    "decay_style": "cosine",
    "weight_decay": 0.01,
    "clip_grad": 1.0,
}


def write_batch(directory) -> str:
    """One seeded batch of token ids and their next-token labels, as both frameworks read it; its path."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 100, (BATCH, SEQ + 1))
    batch = str(directory / "batch.pt")
    torch.save({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}, batch)
    return batch


def _run(model: str, extra: list[str], world: int):
    defaults, flags = MODELS[model]
    return parse_run_config(COMMON + flags + extra, defaults, world)


def _job(model: str, tp: int, batch: str, ops: list[dict]) -> dict:
    return {
        "tp": tp,
        "model": model_record(_run(model, [], 1).model),
        "make_vocab_size_divisible_by": 64,
        "seed": 1234,
        "batch": batch,
        "global_batch_size": BATCH,
        "optimizer": OPTIMIZER,
        "ops": ops,
    }


@pytest.fixture(scope="module")
def saved_by_megatron_core(tmp_path_factory):
    """megatron-core's checkpoints (iteration 0 and 2), logits and 5 training steps per model and tp."""
    megatron_core_python()
    directory = tmp_path_factory.mktemp("mcore")
    batch = write_batch(directory)
    jobs = []
    for model in TRAINED:
        for tp in (1, 2):
            out = directory / f"{model}_tp{tp}"
            jobs.append(
                _job(
                    model,
                    tp,
                    batch,
                    [
                        {"op": "save", "root": str(out / "initial"), "iteration": 0},
                        {"op": "forward", "out": str(out / "logits.pt")},
                        {"op": "grads", "out": str(out / "grads.pt")},
                        {"op": "train", "iters": 2, "out": str(out / "steps_1_2.json")},
                        {"op": "save", "root": str(out / "trained"), "iteration": 2},
                        {"op": "train", "iters": 3, "out": str(out / "steps_3_5.json")},
                    ],
                )
            )
    run_oracle(jobs, directory)
    return directory, batch


def _feed(trainer, batch: dict) -> None:
    """Every iteration trains on `batch`: microbatch m of dp rank d is sample d * microbatches + m."""
    mesh = trainer.mesh

    def batch_fn(iteration):
        def microbatch(m):
            sample = mesh.dp_rank * (BATCH // mesh.dp_size) + m
            tokens, labels = batch["tokens"][sample : sample + 1], batch["labels"][sample : sample + 1]
            return Microbatch(tokens, labels, torch.ones_like(tokens, dtype=torch.float))

        return microbatch

    trainer.batch_fn = batch_fn


def _logits_and_loss(trainer, batch: dict):
    """The full logits and per-token loss of the batch on the last rank (a forward through the stages)."""
    module, mesh = trainer.chunks[0].module.eval(), trainer.mesh
    with torch.no_grad():
        if mesh.pp_size == 1:
            return module(batch["tokens"]), module(batch["tokens"], batch["labels"])
        hidden = torch.empty(SEQ, BATCH, module.config.hidden_size, dtype=module.config.params_dtype)
        if mesh.pp_rank == 0:
            dist.send(module(batch["tokens"]), dist.get_world_size() - 1)
            return None, None
        dist.recv(hidden, 0)
        return module(hidden), module(hidden, batch["labels"])


def _vocabulary_grads(trainer) -> dict:
    """The gradients of iteration 1 of the vocabulary tensors, whole (gathered over tp, padding rows
    included), of a one-stage trainer."""
    trainer.chunks[0].module.train()
    trainer.forward_backward(1)
    grads = {}
    for name, param in trainer.chunks[0].module.named_parameters():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            parts = [torch.empty_like(param.main_grad) for _ in range(trainer.mesh.tp_size)]
            dist.all_gather(parts, param.main_grad.contiguous(), group=trainer.mesh.tp_group)
            grads[name] = torch.cat(parts)
    return grads


def _train(trainer, first: int, last: int) -> dict:
    trainer.chunks[0].module.train()
    losses, norms = [], []
    for iteration in range(first, last + 1):
        loss, *_ = trainer.forward_backward(iteration)
        norms.append(trainer.optimizer.step().grad_norm)
        losses.append(loss)
    return {"loss": losses, "grad_norm": norms}


def _load(model: str, layout: str, root: str, batch: dict, extra: list[str]):
    run = _run(model, LAYOUTS[layout] + ["--load", root] + extra, dist.get_world_size())
    trainer = Trainer(run, torch.device("cpu"))
    iteration, _ = load_checkpoint(checkpoint_to_load(run), trainer, run.checkpoint)
    _feed(trainer, batch)
    return trainer, iteration


def _ours(rank: int, directory: str, batch_file: str) -> dict:
    """For every model, saving tp and layout: logits of the initial checkpoint, the vocabulary tensors'
    gradients of one backward from it (one-stage layouts), 5 steps from it,
    steps 3-5 from the trained one; then a torch_dist save of the tp2 Llama after those steps."""
    batch = torch.load(batch_file)
    results = {}
    for model in TRAINED:
        for tp in (1, 2):
            saved = os.path.join(directory, f"{model}_tp{tp}")
            for layout in LAYOUTS:
                trainer, _ = _load(model, layout, os.path.join(saved, "initial"), batch, ["--no-load-optim"])
                logits, loss = _logits_and_loss(trainer, batch)
                grads = _vocabulary_grads(trainer) if trainer.mesh.pp_size == 1 else None
                steps = _train(trainer, 1, 5)
                trainer, iteration = _load(model, layout, os.path.join(saved, "trained"), batch, [])
                resumed = _train(trainer, iteration + 1, 5)
                results[(model, tp, layout)] = {
                    "logits": logits,
                    "loss": loss,
                    "grads": grads,
                    "steps": steps,
                    "resumed": resumed,
                }
                if (model, tp, layout) in SAVED_BY_US:  # our torch_dist save, for megatron-core to load
                    save_megatron_checkpoint(os.path.join(directory, f"ours_{model}_{layout}"), 5, trainer)
                    results[("saved", model, layout)] = _logits_and_loss(trainer, batch)
                    results[("steps 6-7", model, layout)] = _train(trainer, 6, 7)
    trainer = Trainer(_run(PADDED, LAYOUTS["tp2"], dist.get_world_size()), torch.device("cpu"))  # a fresh run
    _feed(trainer, batch)
    save_megatron_checkpoint(os.path.join(directory, "ours_fresh"), 0, trainer)
    results["fresh"] = _train(trainer, 1, 5)
    return results


def _close(ours, theirs, what: str) -> None:
    ours, theirs = torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(theirs, dtype=torch.float64)
    assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
    assert torch.allclose(ours, theirs, rtol=0, atol=TOL), (what, (ours - theirs).abs().max().item())


def test_megatron_core_checkpoints_load_and_train_in_our_layouts_and_ours_load_in_megatron_core(saved_by_megatron_core):
    directory, batch_file = saved_by_megatron_core
    results = run_distributed(2, _ours, str(directory), batch_file)[-1]  # the last rank holds the logits
    for model in TRAINED:
        for tp in (1, 2):
            saved = directory / f"{model}_tp{tp}"
            reference, reference_grads = torch.load(saved / "logits.pt"), torch.load(saved / "grads.pt")
            steps = {
                k: a + b
                for (k, a), b in zip(
                    json.loads((saved / "steps_1_2.json").read_text()).items(),
                    json.loads((saved / "steps_3_5.json").read_text()).values(),
                )
            }
            for layout in LAYOUTS:
                case, ours = f"{model} saved at tp{tp}, loaded at {layout}", results[(model, tp, layout)]
                _close(ours["logits"], reference["logits"], case + ": logits")
                _close(ours["loss"], reference["loss"], case + ": loss")
                for name, grad in (ours["grads"] or {}).items():  # one-stage layouts
                    _close(grad, reference_grads[name], case + f": iteration 1 gradient of {name}")
                for key in ("loss", "grad_norm"):
                    _close(ours["steps"][key], steps[key], case + f": 5 steps' {key}")
                    _close(ours["resumed"][key], steps[key][2:], case + f": steps 3-5 {key} after the resume")
    # megatron-core loads our torch_dist saves (model and optimizer): the Llama at tp 1 and tp 2, the GPT at tp 1
    loads = [(PADDED, "tp2", 1), (PADDED, "tp2", 2), ("gpt", "pp2", 1)]
    fresh = _job(
        PADDED,
        1,
        batch_file,
        [
            {"op": "load", "root": str(directory / "ours_fresh"), "optimizer": False},
            {"op": "train", "iters": 5, "out": str(directory / "ours_fresh_steps_in_mcore.json")},
        ],
    )
    jobs = [fresh] + [
        _job(
            model,
            tp,
            batch_file,
            [
                {"op": "load", "root": str(directory / f"ours_{model}_{layout}"), "optimizer": True},
                {"op": "forward", "out": str(directory / f"ours_{model}_{layout}_in_mcore_tp{tp}.pt")},
                {"op": "train", "iters": 2, "out": str(directory / f"ours_{model}_{layout}_steps6_7_tp{tp}.json")},
            ],
        )
        for model, layout, tp in loads
    ]
    run_oracle(jobs, directory)
    steps = json.loads((directory / "ours_fresh_steps_in_mcore.json").read_text())
    for key in ("loss", "grad_norm"):  # our initial weights, padding rows included, trained by megatron-core
        _close(
            results["fresh"][key], steps[key], f"our fresh padded Llama at tp2, trained by megatron-core at tp1: {key}"
        )
    for model, layout, tp in loads:
        logits, loss = results[("saved", model, layout)]
        theirs = torch.load(directory / f"ours_{model}_{layout}_in_mcore_tp{tp}.pt")
        case = f"our torch_dist save of the {model} at {layout} loaded by megatron-core at tp{tp}"
        _close(logits, theirs["logits"], case + ": logits")
        _close(loss, theirs["loss"], case + ": loss")
        steps = json.loads((directory / f"ours_{model}_{layout}_steps6_7_tp{tp}.json").read_text())
        for key in ("loss", "grad_norm"):  # step 7's follow from step 6's update: the loaded optimizer state
            _close(results[("steps 6-7", model, layout)][key], steps[key], case + f": steps 6-7 {key}")
