"""Our NullTokenizer has megatron-core's vocabulary size and EOD id for the same --vocab-size, and a
Megatron-LM checkpoint trained with `--tokenizer-type NullTokenizer --vocab-size N` resumes in ours given
the identical flags: Megatron-LM records the N it was given, the model has N + 1 ids (EOD)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from megatron.core.transformer.model_fields import model_record
from megatron.data.tokenizers import build_tokenizer
from megatron.training.arguments.parser import GPT_DEFAULTS, parse_run_config
from megatron.training.checkpoint import checkpoint_to_load, load_checkpoint
from megatron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.mcore_oracle.oracle import megatron_core_python, run_oracle
from tests.mcore_oracle.test_megatron_core import (
    COMMON,
    MODELS,
    _close,
    _feed,
    _job,
    _logits_and_loss,
    _train,
    write_batch,
)

MEGATRON_NULL_TOKENIZER = """
import json, sys
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
sizes = json.loads(sys.argv[1])
print(json.dumps([[NullTokenizer(v).vocab_size, NullTokenizer(v).eod] for v in sizes]))
"""


@pytest.mark.parametrize("sizes", [[2, 50, 1858, 50257]])
def test_null_tokenizer_vocabulary_and_eod_equal_megatron_cores(sizes, tmp_path):
    proc = subprocess.run(
        [megatron_core_python(), "-I", "-c", MEGATRON_NULL_TOKENIZER, json.dumps(sizes)],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,  # -I and not the checkout: our own `megatron` package would shadow megatron-core's
    )
    theirs = json.loads(proc.stdout)
    ours = [[tok.vocab_size, tok.eod] for tok in (build_tokenizer("NullTokenizer", vocab_size=v) for v in sizes)]
    assert ours == theirs


VOCAB = 1858
# the GPT of test_megatron_core.py with Megatron-LM's NullTokenizer: 1859 ids in 1920 rows
NULL_TOKENIZER = MODELS["gpt"][1][:-2] + ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)]


def _ours(rank: int, root: str, batch_file: str) -> dict:
    """Megatron-LM's checkpoint resumed with its own flags: logits and loss there, then 2 steps."""
    batch = torch.load(batch_file)
    run = parse_run_config(COMMON + NULL_TOKENIZER + ["--load", root], GPT_DEFAULTS, 1)
    trainer = Trainer(run, torch.device("cpu"))
    iteration, _ = load_checkpoint(checkpoint_to_load(run), trainer, run.checkpoint)
    _feed(trainer, batch)
    logits, loss = _logits_and_loss(trainer, batch)
    return {"logits": logits, "loss": loss, "steps": _train(trainer, iteration + 1, iteration + 2)}


def test_megatron_lm_null_tokenizer_checkpoint_resumes_with_the_same_flags(tmp_path):
    """megatron-core trains one step and saves as Megatron-LM with `--tokenizer-type NullTokenizer
    --vocab-size 1858` records it; ours loads it with those flags: its logits, loss and next 2 steps."""
    megatron_core_python()
    batch = write_batch(tmp_path)
    model = parse_run_config(COMMON + NULL_TOKENIZER, GPT_DEFAULTS, 1).model
    assert model.vocab_size == VOCAB + 1
    ops = [
        {"op": "train", "iters": 1, "out": str(tmp_path / "step_1.json")},
        {"op": "save", "root": str(tmp_path / "saved"), "iteration": 1},
        {"op": "forward", "out": str(tmp_path / "logits.pt")},
        {"op": "train", "iters": 2, "out": str(tmp_path / "steps_2_3.json")},
    ]
    job = _job("gpt", 1, batch, ops) | {
        "model": model_record(model),
        "lm_args": {"tokenizer_type": "NullTokenizer", "vocab_size": VOCAB},
    }
    run_oracle([job], tmp_path, world=1)
    ours = run_distributed(1, _ours, str(tmp_path / "saved"), batch)[0]
    theirs = torch.load(tmp_path / "logits.pt")
    _close(ours["logits"], theirs["logits"], "logits")
    _close(ours["loss"], theirs["loss"], "loss")
    steps = json.loads((tmp_path / "steps_2_3.json").read_text())
    for key in ("loss", "grad_norm"):
        _close(ours["steps"][key], steps[key], f"steps 2-3 {key}")
