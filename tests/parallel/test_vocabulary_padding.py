"""Megatron's vocabulary padding across layouts: the padded size follows tp (100 tokens: 128 rows at
tp 1, 256 at tp 2, with the default --make-vocab-size-divisible-by 128), and the padding rows are
trained and saved. A load into a layout that pads to fewer rows drops the surplus, one that pads to
more gives the new rows their initial values (those of a fresh run of that layout); each says so
in one note line naming the rows. A fresh run's first rows are the same whatever the padding."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.training.arguments.parser import parse_run_config
from megatron.training.checkpoint import checkpoint_to_load, load_checkpoint, save_checkpoint
from megatron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.parallel.layouts import model_flags, named_params

EMBEDDING = "embedding.word_embeddings.weight"
TP2 = ["--tensor-model-parallel-size", "2"]


def _run(extra: list[str]):
    """The Llama of the equivalence tests with Megatron's default padding (BASE sets another)."""
    defaults, argv = model_flags("llama", ["--make-vocab-size-divisible-by", "128"] + extra)
    return parse_run_config(argv, defaults, dist.get_world_size())


def _trainer(extra: list[str]) -> Trainer:
    return Trainer(_run(extra), torch.device("cpu"))


def _vocabulary(trainer: Trainer) -> dict:
    """The whole vocabulary tensors (gathered over tp) of a one-stage trainer."""
    out = {}
    for name, param in named_params(trainer):
        if name in (EMBEDDING, "output_layer.weight"):
            parts = [torch.empty_like(param) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, param.detach().contiguous())
            out[name] = torch.cat(parts)
    return out


def _train_and_save(rank: int, root: str) -> dict:
    """Two iterations (the padding rows move), then a save; the vocabulary tensors saved and initial."""
    trainer = _trainer(TP2 if dist.get_world_size() == 2 else [])
    initial = _vocabulary(trainer)
    for iteration in (1, 2):
        trainer.forward_backward(iteration)
        trainer.optimizer.step()
    save_checkpoint(root, 2, trainer)
    return {"saved": _vocabulary(trainer), "initial": initial}


def _load(rank: int, root: str) -> tuple[dict, dict, list[str]]:
    """Load `root` into this world's layout; (loaded, fresh initial) vocabulary tensors, notes."""
    extra = (TP2 if dist.get_world_size() == 2 else []) + ["--load", root]
    fresh = _vocabulary(_trainer(extra))
    run = _run(extra)
    trainer = Trainer(run, torch.device("cpu"))
    _, notes = load_checkpoint(checkpoint_to_load(run), trainer, run.checkpoint)
    return _vocabulary(trainer), fresh, notes


def test_padding_rows_follow_tp_are_trained_and_reshard_with_a_note(tmp_path):
    tp1, tp2 = str(tmp_path / "tp1"), str(tmp_path / "tp2")
    one = run_distributed(1, _train_and_save, tp1)[0]
    two = run_distributed(2, _train_and_save, tp2)[0]
    for name, weight in one["saved"].items():
        assert weight.shape[0] == 128 and two["saved"][name].shape[0] == 256, name
        assert torch.equal(two["initial"][name][:128], one["initial"][name]), f"{name}: initial rows differ"
        assert not torch.equal(weight[100:], one["initial"][name][100:]), f"{name}: padding rows not trained"

    loaded, _, notes = run_distributed(1, _load, tp2)[0]  # 256 rows saved, 128 here
    assert f"> note: {tp2}/iter_0000002: vocabulary rows 128..255 of the checkpoint dropped (padding; " in "\n".join(
        notes
    ), notes
    for name, weight in loaded.items():
        assert torch.equal(weight, two["saved"][name][:128]), name

    loaded, fresh, notes = run_distributed(2, _load, tp1)[0]  # 128 rows saved, 256 here
    assert any(
        note.startswith(f"> note: {tp1}/iter_0000002: vocabulary rows 128..255 are not in the checkpoint (128 rows")
        for note in notes
    ), notes
    for name, weight in loaded.items():
        assert torch.equal(weight[:128], one["saved"][name]), name
        assert torch.equal(weight[128:], fresh[name][128:]), f"{name}: new rows are not the initial ones"
