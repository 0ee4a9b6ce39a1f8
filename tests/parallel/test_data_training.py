"""Training on the shipped corpus (preprocessed with the shipped GPT-2 BPE tokenizer): every
layout gives the one-rank losses and validation loss; bad data inputs are one clear line."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron.data.indexed_dataset import IndexedDatasetWriter, token_dtype
from megatron.training.arguments.parser import GPT_DEFAULTS, parse_run_config
from megatron.training.evaluation import evaluate
from megatron.training.trainer import Trainer
from tests.cli import BPE, GPT2_BPE, explain, run_cli
from tests.distributed import run_distributed

TOKENIZER = GPT2_BPE
MODEL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "3",
    "--lr",
    "3e-3",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
    "--split",
    "90,10,0",
    "--eod-mask-loss",
    "--eval-iters",
    "2",
    "--eval-interval",
    "3",
    # the softmax spans Megatron's vocabulary padding, a multiple of this x tp: 1858 tokens pad to
    # 1920 rows at tp 1 and tp 2 alike, so every layout computes one loss
    "--make-vocab-size-divisible-by",
    "64",
]
LAYOUTS = {
    1: [[]],
    # zbv: validation's forward-only pass through the V (the loss on pp rank 0, the turn on rank 1)
    2: [[], ["--context-parallel-size", "2"], ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"]],
    4: [
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
        ]
    ],
}


def train_on_corpus(rank, prefix, layouts):
    out = []
    for extra in layouts:
        run = parse_run_config(MODEL + TOKENIZER + ["--data-path", prefix] + extra, GPT_DEFAULTS, dist.get_world_size())
        trainer = Trainer(run, torch.device("cpu"))
        losses = [trainer.train_step(i).loss for i in range(1, 4)]
        out.append({"losses": losses, "valid": evaluate(trainer, "valid", 0), "vocab": run.model.vocab_size})
        trainer.close()
    return out


def test_every_layout_trains_on_the_corpus_like_one_rank(corpus):
    results = {world: run_distributed(world, train_on_corpus, corpus, layouts) for world, layouts in LAYOUTS.items()}
    reference = results[1][0][0]
    assert reference["vocab"] == 1858, "the vocabulary comes from the tokenizer"
    assert all(np.isfinite(reference["losses"])) and reference["losses"][-1] < reference["losses"][0]
    for world, per_rank in results.items():
        for index in range(len(LAYOUTS[world])):
            for rank, runs in enumerate(per_rank):
                got = runs[index]
                np.testing.assert_allclose(
                    got["losses"], reference["losses"], rtol=1e-5, err_msg=f"world {world} layout {index} rank {rank}"
                )
                assert abs(got["valid"] - reference["valid"]) <= 1e-5 * reference["valid"], (world, index, rank)


def _error(argv) -> str:
    with pytest.raises(ValueError) as failure:
        parse_run_config(MODEL + argv, GPT_DEFAULTS, 1)
    return str(failure.value)


def test_bad_data_flags_are_one_clear_line(corpus, tmp_path):
    assert (
        _error(TOKENIZER + ["--data-path", str(tmp_path / "nope")]) == f"--data-path {tmp_path / 'nope'}: "
        f"{tmp_path / 'nope'}.bin not found"
    )
    missing = [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(tmp_path / "v.json"),
        "--merge-file",
        str(BPE / "merges.txt"),
    ]
    assert _error(missing + ["--data-path", corpus]) == f"--vocab-file {tmp_path / 'v.json'}: no such file"
    assert "not both" in _error(TOKENIZER + ["--data-path", corpus, "--mock-data", "--vocab-size", "10"])
    assert "no training data" in _error([])


def _vocabulary_too_small(rank, prefix):
    run = parse_run_config(
        MODEL + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50", "--data-path", prefix],
        GPT_DEFAULTS,
        dist.get_world_size(),
    )
    trainer = Trainer(run, torch.device("cpu"))  # start-up reads no token of the .bin
    try:
        trainer.train_step(1)
    except ValueError as error:
        return str(error)
    finally:
        trainer.close()
    return None


def test_tokens_outside_the_vocabulary_stop_every_rank_with_one_line(tmp_path):
    prefix = str(tmp_path / "ids")
    with IndexedDatasetWriter(prefix, token_dtype(1000)) as writer:
        for start in range(0, 400, 40):
            writer.add_document(
                51 + np.arange(start, start + 40) % 100
            )  # all outside --vocab-size 50: ids 0-49, EOD 50
    for error in run_distributed(2, _vocabulary_too_small, prefix):
        assert re.fullmatch(
            rf"{re.escape(prefix)}\.bin: token id \d+ \(in train sample \d+\) is outside the "
            r"tokenizer's vocabulary of 51 ids; was it preprocessed with another tokenizer\?",
            error,
        ), error


def test_cli_preprocess_then_torchrun_matches_one_rank(corpus):
    flags = MODEL + TOKENIZER + ["--data-path", corpus, "--log-interval", "1"]
    one = run_cli("pretrain_gpt.py", flags)
    two = run_cli("pretrain_gpt.py", flags + ["--tensor-model-parallel-size", "2"], nproc=2)
    assert one.returncode == 0, explain(one)
    assert two.returncode == 0, explain(two)
    pattern = r"(?:lm loss|validation loss at iteration 3 on validation set \| lm loss value): (\S+) \|"
    printed = [[float(x) for x in re.findall(pattern, out.stdout)] for out in (one, two)]
    assert len(printed[0]) == 4, one.stdout  # three iterations and the final validation
    np.testing.assert_allclose(printed[1], printed[0], rtol=1e-5)  # the 7th digit may differ: summation order
