"""FP8 delayed scaling's state in checkpoints: resumed bit for bit in the same layout, resharded into another
(the one-process continuation tracks the TP2 one as FP8 layouts do), and optional both ways: a checkpoint
without it starts an FP8 run, and an FP8 checkpoint loads into a run without FP8 (fp32 weights here)."""

from __future__ import annotations

import os

import torch

from megatron.training.checkpoint import checkpoint_to_load, load_checkpoint, save_checkpoint
from megatron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.parallel.test_checkpoint_resume import _run, _steps

FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


def _scales(trainer) -> dict:
    return {
        name: buffer.clone()
        for chunk in trainer.chunks
        for name, buffer in chunk.module.named_buffers()
        if name.endswith(("fp8_scale", "fp8_amax_history"))
    }


def _load(flags: list[str], root: str):
    run = _run("llama", flags + ["--load", root])
    trainer = Trainer(run, torch.device("cpu"))
    iteration, notes = load_checkpoint(checkpoint_to_load(run), trainer, run.checkpoint)
    return trainer, iteration, notes


def _save_tp2(rank: int, root: str) -> dict:
    """FP8 on TP2: 6 iterations straight; stopped after 3, saved and resumed; and a run without FP8 saved."""
    straight = _steps(Trainer(_run("llama", FP8 + TP2), torch.device("cpu")), 1, 6)
    stopped = Trainer(_run("llama", FP8 + TP2), torch.device("cpu"))
    _steps(stopped, 1, 3)
    save_checkpoint(os.path.join(root, "fp8"), 3, stopped)
    saved_state = _scales(stopped)
    resumed, iteration, _ = _load(FP8 + TP2, os.path.join(root, "fp8"))
    loaded_state = _scales(resumed)
    plain = Trainer(_run("llama", TP2), torch.device("cpu"))
    _steps(plain, 1, 3)
    save_checkpoint(os.path.join(root, "plain"), 3, plain)
    return {
        "straight": straight[3:],
        "resumed": _steps(resumed, iteration + 1, 6),
        "state_equal": all(torch.equal(saved_state[k], loaded_state[k]) for k in saved_state),
        "state": saved_state,
    }


def _load_one_process(rank: int, root: str) -> dict:
    resharded, iteration, notes = _load(FP8, os.path.join(root, "fp8"))
    state = _scales(resharded)
    out = {"resharded": _steps(resharded, iteration + 1, 6), "resharded_state": state, "notes": {"fp8": notes}}
    fp8_from_plain, iteration, out["notes"]["fp8_from_plain"] = _load(FP8, os.path.join(root, "plain"))
    out["fp8_from_plain"] = _steps(fp8_from_plain, iteration + 1, 6)
    plain_from_fp8, iteration, out["notes"]["plain_from_fp8"] = _load([], os.path.join(root, "fp8"))
    out["plain_from_fp8"] = _steps(plain_from_fp8, iteration + 1, 6)
    return out


def test_fp8_state_resumes_exactly_reshards_and_is_optional(tmp_path):
    root = str(tmp_path)
    tp2 = run_distributed(2, _save_tp2, root)
    one = run_distributed(1, _load_one_process, root)[0]
    for rank in tp2:
        assert rank["state_equal"] and rank["state"], "the loaded amax histories and scales are the saved ones"
        assert rank["straight"] == rank["resumed"], (rank["straight"], rank["resumed"])  # bit for bit
    # TP ranks hold the same reduced state; one process loads it whole and continues as TP2 does
    for name, value in tp2[0]["state"].items():
        assert torch.equal(one["resharded_state"][name], value), name
    for (loss, norm), (expected, expected_norm) in zip(one["resharded"], tp2[0]["straight"]):
        assert abs(loss - expected) <= 2e-3 * expected and abs(norm - expected_norm) <= 2e-2 * expected_norm
    assert not any("FP8" in line for line in one["notes"]["fp8"])
    assert any("holds no FP8 delayed-scaling state" in line for line in one["notes"]["fp8_from_plain"])
    assert any(
        "FP8 delayed-scaling state in the checkpoint not used" in line for line in one["notes"]["plain_from_fp8"]
    )
    for name in ("fp8_from_plain", "plain_from_fp8"):
        assert all(loss == loss and norm is not None for loss, norm in one[name]), name
