"""--ckpt-format torch_dist (Megatron-LM's format) without megatron-core: a save loads back bit for
bit, and a truncated shard file or a model flag that differs is refused with one line.
Agreement with megatron-core itself: tests/mcore_oracle/test_megatron_core.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron.core.checkpointing import CheckpointError, TensorPiece, read_pieces, saved_tensors
from megatron.training.arguments.parser import parse_run_config
from megatron.training.checkpoint import checkpoint_to_load, load_checkpoint, save_checkpoint
from megatron.training.checkpoint.directory import MEGATRON, OURS, detect_checkpoint_format
from megatron.training.checkpoint.torch_dist import save_megatron_checkpoint
from megatron.training.trainer import Trainer
from tests.cli import TINY_LLAMA, printed_losses, run_cli
from tests.distributed import run_distributed
from tests.parallel.layouts import model_flags, named_params
from tools.checkpoint.convert import main as convert

TP2 = ["--tensor-model-parallel-size", "2"]


def _trainer(extra: list[str]) -> Trainer:
    defaults, argv = model_flags("llama", extra)
    return Trainer(parse_run_config(argv, defaults, dist.get_world_size()), torch.device("cpu"))


def _state(trainer) -> dict:
    """Weights, Adam moments and step count, copied."""
    state = {name: p.detach().clone() for name, p in named_params(trainer)}
    for name, ranges in trainer.optimizer.state_dict_by_name().items():
        if name != "step":
            state.update(
                {f"{key}.{name}.{start}": view.clone() for start, _, views in ranges for key, view in views.items()}
            )
    state["scalars"] = trainer.optimizer.scalar_state()  # step count, loss scaler
    return state


def _round_trip(rank: int, root: str) -> list[str]:
    """fp32, and fp16 (master weights, a dynamic loss scaler): save torch_dist, load, compare."""
    differ = []
    for precision in ([], ["--fp16"]):
        trainer = _trainer(TP2 + precision)
        for iteration in (1, 2):
            trainer.forward_backward(iteration)
            trainer.optimizer.step()
        megatron = os.path.join(root, "megatron" + "".join(precision))
        save_megatron_checkpoint(megatron, 2, trainer)
        if not precision:
            save_checkpoint(os.path.join(root, "ours"), 2, trainer)
        expected = _state(trainer)
        defaults, argv = model_flags("llama", TP2 + precision + ["--seed", "9", "--load", megatron])
        run = parse_run_config(argv, defaults, dist.get_world_size())
        loaded = Trainer(run, torch.device("cpu"))
        iteration, _ = load_checkpoint(checkpoint_to_load(run), loaded, run.checkpoint)
        state = _state(loaded)
        differ += [
            f"{precision} {k}"
            for k, v in expected.items()
            if not (torch.equal(v, state[k]) if torch.is_tensor(v) else v == state[k])
        ]
        differ += [] if iteration == 2 else [f"{precision} iteration {iteration}"]
    return differ


def _model_tensors(root: str, iteration: int) -> dict:
    """Every model tensor (not optimizer, not RNG) of a checkpoint, whole."""
    directory = os.path.join(root, f"iter_{iteration:07d}")
    tensors = {
        name: torch.empty(shape, dtype=dtype)
        for name, (shape, dtype) in saved_tensors(directory).items()
        if not name.startswith(("optimizer.", "rng."))
    }
    read_pieces([TensorPiece.whole(name, t) for name, t in tensors.items()], directory)
    return tensors


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(t, b[name]) for name, t in a.items())


def test_torch_dist_round_trip_is_bit_identical_and_bad_checkpoints_are_refused(tmp_path, capsys):
    root = str(tmp_path)
    assert run_distributed(2, _round_trip, root) == [[], []]
    assert detect_checkpoint_format(os.path.join(root, "megatron")) == MEGATRON
    assert detect_checkpoint_format(os.path.join(root, "ours")) == OURS
    assert detect_checkpoint_format(root) is None
    # the converter: torch_dist -> canonical gives our save's model tensors, and back (at the saving tp) the
    # torch_dist save's

    canonical, megatron = os.path.join(root, "converted"), os.path.join(root, "converted_back")
    assert (
        convert(
            [
                "--loader",
                "torch_dist",
                "--saver",
                "canonical",
                "--load-dir",
                os.path.join(root, "megatron"),
                "--save-dir",
                canonical,
            ]
        )
        == 0
    )
    assert _same(_model_tensors(canonical, 0), _model_tensors(os.path.join(root, "ours"), 2))
    assert (
        convert(
            [
                "--loader",
                "mcore",
                "--saver",
                "torch_dist",
                "--load-dir",
                canonical,
                "--save-dir",
                megatron,
                "--target-tensor-parallel-size",
                "2",
                "--make-vocab-size-divisible-by",  # the saving run's (layouts.BASE): the same padded rows
                "32",
            ]
        )
        == 0
    )  # mcore: the old name of canonical
    assert _same(_model_tensors(megatron, 0), _model_tensors(os.path.join(root, "megatron"), 2))
    # for Megatron-LM's default padding at tp 2 (256 rows): the 128 saved rows, then new rows drawn as
    # Megatron initialises padding, with a note
    wider = os.path.join(root, "padded_wider")
    capsys.readouterr()
    argv = ["--loader", "canonical", "--saver", "torch_dist", "--load-dir", canonical, "--save-dir", wider]
    assert convert(argv + ["--target-tensor-parallel-size", "2"]) == 0
    assert (
        f"> note: {canonical}: vocabulary rows 128..255 are not in the checkpoint (128 rows;" in capsys.readouterr().err
    )
    saved, padded = _model_tensors(canonical, 0), _model_tensors(wider, 0)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert padded[name].shape[0] == 256 and torch.equal(padded[name][:128], saved[name]), name
        assert abs(padded[name][128:].std().item() - 0.02) < 0.002, name  # --init-method-std

    def refusal(extra: list[str]) -> str:
        defaults, argv = model_flags("llama", extra + ["--load", os.path.join(root, "megatron")])
        with pytest.raises(CheckpointError) as error:
            checkpoint_to_load(parse_run_config(argv, defaults, 2))
        return str(error.value)

    defaults, argv = model_flags("llama", ["--lr", "0.5", "--load", os.path.join(root, "megatron")])
    notes = checkpoint_to_load(parse_run_config(argv, defaults, 2)).notes
    assert any("LR schedule differs from the flags', which are used: max_lr 0.003 (flags: 0.5)" in n for n in notes)
    assert "saved with --hidden-size 64, the flags give 32" in refusal(["--hidden-size", "32"])
    assert "saved with --num-query-groups 4, the flags give 2" in refusal(["--num-query-groups", "2"])
    shard = os.path.join(root, "megatron", "iter_0000002", "__1_0.distcp")
    with open(shard, "r+b") as handle:
        handle.truncate(os.path.getsize(shard) // 2)
    message = refusal([])
    assert shard in message and "truncated" in message and "\n" not in message


DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--tensor-model-parallel-size", "2"]


def test_cli_resumes_a_torch_dist_checkpoint_with_its_rng_states_and_refuses_one_of_another_model(tmp_path):
    """With dropout at tp 2, iteration 3 resumed from a torch_dist save of iteration 2 (the distributed
    optimizer's buckets, the RNG states as Megatron-LM stores them) prints the uninterrupted run's loss."""
    flags = TINY_LLAMA + DROPOUT + ["--use-distributed-optimizer", "--ckpt-format", "torch_dist"]
    uninterrupted = run_cli("pretrain_llama.py", flags + ["--train-iters", "3"], nproc=2)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-2000:]
    stop_after_2 = ["--save", str(tmp_path), "--train-iters", "3", "--exit-interval", "2"]  # the same LR schedule
    save = run_cli("pretrain_llama.py", flags + stop_after_2, nproc=2)
    assert save.returncode == 0, save.stderr[-2000:]
    assert detect_checkpoint_format(str(tmp_path)) == MEGATRON
    proc = run_cli("pretrain_llama.py", TINY_LLAMA + ["--hidden-size", "64", "--load", str(tmp_path)])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path}/iter_0000002: saved with --hidden-size 32, the flags give 64"
    ]
    resumed = run_cli("pretrain_llama.py", flags + ["--load", str(tmp_path), "--train-iters", "3"], nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"> loaded {tmp_path}/iter_0000002 (iteration 2)" in resumed.stdout
    assert "RNG states not" not in resumed.stdout
    assert printed_losses(resumed.stdout) == printed_losses(uninterrupted.stdout)[2:]  # iteration 3, exactly


# How a Python pickles an enum member: 3.11 by name (getattr(cls, name)), 3.10 and 3.12+ by value (cls(value)).
ENUM_PICKLE_FORMS = {
    "by-name": lambda member: (getattr, (type(member), member.name)),
    "by-value": lambda member: (type(member), (member.value,)),
}


@pytest.mark.parametrize("form", list(ENUM_PICKLE_FORMS))
def test_common_pt_with_megatron_classes_reads_without_them(form, tmp_path, monkeypatch):
    """Megatron-LM's args hold its enums and configs: common.pt unpickles with stand-ins for them,
    whichever way the saving Python pickled an enum member (each form written explicitly)."""
    import argparse
    import enum
    import sys
    import types

    from megatron.training.checkpoint.torch_dist import read_common

    module = types.ModuleType("megatron.core.not_ours")

    class AttnBackend(enum.Enum):
        auto = 5

        def __reduce_ex__(self, protocol):
            return ENUM_PICKLE_FORMS[form](self)

    AttnBackend.__module__, AttnBackend.__qualname__ = "megatron.core.not_ours", "AttnBackend"
    module.AttnBackend = AttnBackend
    monkeypatch.setitem(sys.modules, "megatron.core.not_ours", module)
    args = argparse.Namespace(hidden_size=32, attention_backend=AttnBackend.auto, params_dtype=torch.bfloat16)
    torch.save({"args": args, "iteration": 7}, tmp_path / "common.pt")
    monkeypatch.delitem(sys.modules, "megatron.core.not_ours")
    common = read_common(str(tmp_path))
    assert common["iteration"] == 7 and common["args"].hidden_size == 32
    assert common["args"].params_dtype == torch.bfloat16
    backend = common["args"].attention_backend
    assert type(backend).__name__ == "AttnBackend"
    assert (backend.name if form == "by-name" else backend.args) == ("auto" if form == "by-name" else (5,))
    (tmp_path / "common.pt").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="common.pt: unreadable"):
        read_common(str(tmp_path))
