"""Exact resume and resharding with optimizer state.

Resume: a run stopped after iteration 3, saved, loaded by a fresh trainer and run to 6 gives,
bit for bit, the losses and grad norms of iterations 4-6 of the uninterrupted run (same layout;
bf16 and fp16 with a growing loss scale, distributed optimizer, dropout on).
Reshard: what TP2 x PP2 (2 virtual stages) saved after 3 iterations continues in other layouts
(TP1 x PP4, TP4, DP4 with the distributed optimizer, CP2) as the one-rank continuation does.
Batch size: saved at global batch 8 after 3 iterations, resumed at 16, the run reads from sample 24 on.
Async save: written in the background while iteration 4 changes the weights, the checkpoint of
iteration 3 resumes bit for bit; the tracker moves only when the save is finalized.
"""

from __future__ import annotations

import json
import os
import threading

import torch
import torch.distributed as dist

from megatron.core.checkpointing import write_pieces_with_digests
from megatron.data.batches import microbatch_indices
from megatron.training.arguments.parser import parse_run_config
from megatron.training.checkpoint import CheckpointSaver, checkpoint_to_load, load_checkpoint, save_checkpoint
from megatron.training.checkpoint import save as checkpoint_saver
from megatron.training.checkpoint.directory import TRACKER
from megatron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.parallel.layouts import model_flags, named_params

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
FP16 = ["--fp16", "--initial-loss-scale", "4096", "--loss-scale-window", "2"]  # the scale grows while it runs
DIST_OPT = ["--use-distributed-optimizer"]
RESUME_CASES = {
    2: [
        ("llama", ["--bf16"] + DIST_OPT),
        ("llama", ["--optimizer-cpu-offload"] + DIST_OPT),  # fp32 weights, master weights in host memory
        ("gpt", ["--tensor-model-parallel-size", "2", "--sequence-parallel"] + FP16 + DROPOUT),
        (
            "gpt",
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1", "--bf16"] + DROPOUT,
        ),
        # zbv: both copies of the tied embedding (and their optimizer state) on pp rank 0
        ("gpt", ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv", "--bf16"] + DIST_OPT + DROPOUT),
    ],
    4: [
        (
            "llama",
            [
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
            ]
            + FP16
            + DIST_OPT,
        ),
        (
            "gpt",
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--bf16",
                "--overlap-param-gather",
            ]
            + DIST_OPT
            + DROPOUT,
        ),
    ],
}
SAVED_LAYOUT = [
    "--tensor-model-parallel-size",
    "2",
    "--pipeline-model-parallel-size",
    "2",
    "--num-layers-per-virtual-pipeline-stage",
    "1",
]
RESHARDED = {
    4: [
        ["--pipeline-model-parallel-size", "4"],
        ["--tensor-model-parallel-size", "4"],
        ["--use-distributed-optimizer"],
    ],
    2: [["--context-parallel-size", "2"]],
    1: [[]],
}


def _run(model: str, extra: list[str]):
    defaults, argv = model_flags(model, ["--train-iters", "6"] + extra)
    return parse_run_config(argv, defaults, dist.get_world_size())


def _steps(trainer: Trainer, first: int, last: int) -> list[tuple[float, float | None]]:
    results = [trainer.train_step(i) for i in range(first, last + 1)]
    return [(r.loss, r.grad_norm) for r in results]


def _resumed(model: str, flags: list[str], root: str) -> list:
    run = _run(model, flags + ["--load", root])
    trainer = Trainer(run, torch.device("cpu"))
    iteration, _ = load_checkpoint(checkpoint_to_load(run), trainer, run.checkpoint)
    return _steps(trainer, iteration + 1, 6)


def _resume_cases(rank: int, root: str, cases: list) -> list:
    out = []
    for index, (model, flags) in enumerate(cases):
        straight = _steps(Trainer(_run(model, flags), torch.device("cpu")), 1, 6)
        stopped = Trainer(_run(model, flags), torch.device("cpu"))
        _steps(stopped, 1, 3)
        save_checkpoint(os.path.join(root, str(index)), 3, stopped)
        out.append((straight[3:], _resumed(model, flags, os.path.join(root, str(index)))))
    return out


def test_resume_repeats_the_uninterrupted_run_bit_for_bit(tmp_path):
    for world, cases in RESUME_CASES.items():
        results = run_distributed(world, _resume_cases, str(tmp_path / str(world)), cases)
        for rank_results in results:
            for (model, flags), (straight, resumed) in zip(cases, rank_results):
                assert straight == resumed, (model, flags, straight, resumed)
                assert any(norm is not None for _, norm in resumed), (model, flags)


def _fp32_run_loads_bf16_master_weights(rank: int, root: str) -> list[str]:
    """A bf16 run saves fp32 master weights; an fp32 run, whose parameters are its own master weights,
    loads them: its parameters are those exact values, not the saved bf16 model tensors. Returns the
    names of the parameters that differ."""
    bf16 = Trainer(_run("llama", ["--bf16"]), torch.device("cpu"))
    _steps(bf16, 1, 2)  # the master weights move off the bf16 grid
    save_checkpoint(root, 2, bf16)
    masters = {
        name: torch.cat([views["master"] for _, _, views in ranges])
        for name, ranges in bf16.optimizer.state_dict_by_name().items()
        if name != "step"
    }
    run = _run("llama", ["--load", root])
    trainer = Trainer(run, torch.device("cpu"))
    load_checkpoint(checkpoint_to_load(run), trainer, run.checkpoint)
    return [name for name, p in named_params(trainer) if not torch.equal(p.detach().flatten(), masters[name])]


def test_an_fp32_run_loads_the_exact_fp32_master_weights_of_a_bf16_checkpoint(tmp_path):
    assert run_distributed(1, _fp32_run_loads_bf16_master_weights, str(tmp_path))[0] == []


def _save_and_continue(rank: int, root: str, layouts: list) -> list:
    """Save TP2 x PP2 after 3 iterations (4 ranks), then continue in each of `layouts`."""
    trainer = Trainer(_run("llama", SAVED_LAYOUT), torch.device("cpu"))
    _steps(trainer, 1, 3)
    save_checkpoint(root, 3, trainer)
    return [_resumed("llama", layout, root) for layout in layouts]


def _continue(rank: int, root: str, layouts: list) -> list:
    return [_resumed("llama", layout, root) for layout in layouts]


def test_optimizer_state_reshards_into_any_layout(tmp_path):
    root = str(tmp_path)
    resumed = {4: run_distributed(4, _save_and_continue, root, RESHARDED[4])[0]}
    for world in (2, 1):
        resumed[world] = run_distributed(world, _continue, root, RESHARDED[world])[0]
    reference = torch.tensor(resumed[1][0], dtype=torch.float64)
    for world in (4, 2):
        for layout, steps in zip(RESHARDED[world], resumed[world]):
            torch.testing.assert_close(
                torch.tensor(steps, dtype=torch.float64),
                reference,
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m, layout=layout: f"{layout}: {m}",
            )


class _Recording:
    """A dataset that records which sample indices were read."""

    def __init__(self, dataset):
        self.dataset, self.read = dataset, set()

    def __getitem__(self, index):
        self.read.add(index)
        return self.dataset[index]

    def __len__(self):
        return len(self.dataset)


def _batch_size_changed(rank: int, root: str) -> dict:
    stopped = Trainer(_run("llama", []), torch.device("cpu"))  # global batch 8
    _steps(stopped, 1, 3)
    save_checkpoint(root, 3, stopped)
    run = _run("llama", ["--global-batch-size", "16", "--load", root])
    info = checkpoint_to_load(run)  # before the Trainer, as pretrain does: the datasets are sized after it
    trainer = Trainer(run, torch.device("cpu"))
    iteration, notes = load_checkpoint(info, trainer, run.checkpoint)
    lr_at_resume = trainer.learning_rates()[0]
    trainer.dataset = recording = _Recording(trainer.dataset)
    steps = _steps(trainer, iteration + 1, 6)
    return {
        "iteration": iteration,
        "notes": notes,
        "plans": [trainer._train_plan(i) for i in range(4, 7)],
        "read": recording.read,
        "steps": steps,
        "lr": (lr_at_resume, run.lr_schedule(24)),
        "lr_after": (trainer.learning_rates()[0], run.lr_schedule(72)),
        "saved_after": json.load(open(os.path.join(save_checkpoint(root, 6, trainer), "metadata.json"))),
    }


def test_resume_with_another_global_batch_size_continues_from_the_saved_samples(tmp_path):
    results = run_distributed(2, _batch_size_changed, str(tmp_path))  # dp = 2
    first = results[0]
    assert first["iteration"] == 3
    assert any(
        "24 samples consumed by iteration 3 (the flags' batch sizes would give 48); continuing from sample 24" in line
        for line in first["notes"]
    ), first["notes"]
    # an uninterrupted run at global batch 16 from sample 24: iteration k reads 24 + 16 (k - 1) onwards
    assert first["plans"] == [(24, 4), (40, 4), (56, 4)]
    expected = {
        i
        for k, consumed in enumerate((24, 40, 56))
        for rank in range(2)
        for mb in range(4)
        for i in microbatch_indices(consumed, mb, micro_batch_size=2, dp_size=2, dp_rank=rank)
    }
    assert expected == set(range(24, 72))
    read = set().union(*(r["read"] for r in results))
    assert expected <= read and read - expected <= set(range(72, 88)), sorted(read)  # plus iteration 7 prefetched
    assert all(loss == loss and norm is not None for loss, norm in first["steps"]), first["steps"]
    assert first["lr"][0] == first["lr"][1] and first["lr_after"][0] == first["lr_after"][1], first
    assert first["saved_after"]["consumed_samples"] == 72 and first["saved_after"]["update_samples"] == 72


ASYNC_CASE = ("llama", ["--bf16"] + DIST_OPT + DROPOUT)


def _tracker(root: str) -> str | None:
    path = os.path.join(root, TRACKER)
    return open(path).read() if os.path.isfile(path) else None


def _async_saves(rank: int, root: str) -> dict:
    model, flags = ASYNC_CASE
    straight = _steps(Trainer(_run(model, flags), torch.device("cpu")), 1, 6)
    trainer = Trainer(_run(model, flags), torch.device("cpu"))
    saver = CheckpointSaver(root, trainer, lambda line: None, asynchronous=True)
    _steps(trainer, 1, 1)
    saver.save(1)
    saver.finish()
    _steps(trainer, 2, 3)
    released = threading.Event()  # the writer starts only after iteration 4 has changed the weights
    checkpoint_saver.write_pieces_with_digests = lambda *args: (released.wait(), write_pieces_with_digests(*args))[1]
    try:
        saver.save(3)
        _steps(trainer, 4, 4)
        saver.poll()  # the writers are held: nothing is finalized
        pending = {"tracker": _tracker(root), "final": os.path.isdir(os.path.join(root, "iter_0000003"))}
        released.set()
        saver.finish()
    finally:
        checkpoint_saver.write_pieces_with_digests = write_pieces_with_digests
    finalized = _tracker(root)
    directory = os.path.join(root, "iter_0000003")
    with open(os.path.join(directory, "metadata.json")) as handle:
        recorded = sorted(json.load(handle)["files"])
    on_disk = sorted(set(os.listdir(directory)) - {"metadata.json"})
    resumed = _resumed(model, flags, root)
    saver.save(5)  # a crash before finalizing: the writer finishes, nothing finalizes the save
    saver.pending.written.result()
    dist.barrier()
    crashed = {
        "tracker": _tracker(root),
        "tmp": os.path.isdir(os.path.join(root, "iter_0000005.tmp")),
        "loads": checkpoint_to_load(_run(model, flags + ["--load", root])).iteration,
    }
    return {
        "straight": straight[3:],
        "resumed": resumed,
        "pending": pending,
        "finalized": finalized,
        "crashed": crashed,
        "recorded": recorded,
        "on_disk": on_disk,
    }


def test_async_save_resumes_bit_for_bit_and_moves_the_tracker_only_when_finalized(tmp_path):
    for result in run_distributed(2, _async_saves, str(tmp_path)):
        assert result["pending"] == {"tracker": "1", "final": False}, result["pending"]
        assert result["finalized"] == "3"
        assert result["resumed"] == result["straight"], result
        assert result["crashed"] == {"tracker": "3", "tmp": True, "loads": 3}, result["crashed"]
        assert result["recorded"] == result["on_disk"], result  # every rank's files carry a digest
