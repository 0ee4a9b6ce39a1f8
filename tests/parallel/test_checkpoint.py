"""Checkpoints: any layout loads what any layout saved; bad checkpoints stop with one line.

Weights are first set to layout-independent random values (every parameter, norms and
biases included, drawn like an initialisation with another seed), so the expected
weights of any layout are known exactly: a load must reproduce them bit for bit.
Exact resume and resharding of the optimizer state: test_checkpoint_resume.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.core.checkpointing import CheckpointError
from megatron.core.tensor_parallel.initialization import initialize_
from megatron.training.arguments.checkpoint import CheckpointConfig
from megatron.training.arguments.parser import parse_run_config
from megatron.training.checkpoint import canonical, checkpoint_to_load, load_checkpoint, save_checkpoint, state
from megatron.training.run_control import RunControl
from megatron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.parallel.layouts import model_flags, named_params

ROOT = Path(__file__).resolve().parents[2]
SAVED_LAYOUT = [
    "--tensor-model-parallel-size",
    "2",
    "--pipeline-model-parallel-size",
    "2",
    "--num-layers-per-virtual-pipeline-stage",
    "1",
]
LOAD_LAYOUTS = {
    1: [[]],
    4: [
        ["--tensor-model-parallel-size", "4"],
        ["--pipeline-model-parallel-size", "2"],
        SAVED_LAYOUT,
        # zbv's V placement: layers 0 and 3 (and both ends of GPT's tied embedding) on pp rank 0
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"],
    ],
}
MODELS = ("gpt", "llama")


def _run(model: str, extra: list[str]):
    defaults, argv = model_flags(model, extra)
    return parse_run_config(argv, defaults, dist.get_world_size())


def _randomize(trainer, seed: int = 77) -> None:
    """Every parameter drawn from N(0, 0.5) as a layout-independent initialisation with `seed`."""
    for name, param in named_params(trainer):
        spec = dataclasses.replace(param.init_spec, kind="normal", std=0.5)
        initialize_(param.detach(), spec, seed, name)


def _weights(trainer) -> dict:
    return {name: p.detach().clone() for name, p in named_params(trainer)}


def _save(rank: int, root: str) -> dict:
    rng = {}
    for model in MODELS:
        trainer = Trainer(_run(model, SAVED_LAYOUT), torch.device("cpu"))
        _randomize(trainer)
        trainer.forward_backward(1)  # advance the dropout streams so saved RNG states are not the initial ones
        save_checkpoint(os.path.join(root, model), 3, trainer)
        rng[model] = state.rng_states(trainer)
    return rng


def _load(rank: int, root: str, layout: list[str]) -> dict:
    rng, mismatches = {}, []
    for model in MODELS:
        run = _run(model, layout + ["--seed", "5", "--load", os.path.join(root, model), "--no-load-optim"])
        trainer = Trainer(run, torch.device("cpu"))
        before = _weights(trainer)
        _randomize(trainer)
        expected = _weights(trainer)
        for name, p in named_params(trainer):
            p.detach().copy_(before[name])
        iteration, _ = load_checkpoint(checkpoint_to_load(run), trainer, run.checkpoint)
        assert iteration == 3
        mismatches += [f"{model} {name}" for name, w in _weights(trainer).items() if not torch.equal(w, expected[name])]
        rng[model] = state.rng_states(trainer)
    return {"mismatches": mismatches, "rng": rng}


def test_any_layout_loads_what_tp2_pp2_vpp2_saved(tmp_path):
    root = str(tmp_path)
    saved_rng = run_distributed(4, _save, root)
    for world, layouts in LOAD_LAYOUTS.items():
        for layout in layouts:
            results = run_distributed(world, _load, root, layout)
            assert not [m for r in results for m in r["mismatches"]], (layout, results[0]["mismatches"][:5])
            if layout == SAVED_LAYOUT:  # RNG states come back only into the layout that saved them
                for saved, loaded in zip(saved_rng, results):
                    for model in MODELS:
                        assert all(torch.equal(state, loaded["rng"][model][k]) for k, state in saved[model].items())


def _bf16_master_weights(rank: int, root: str) -> bool:
    """A bf16 run's first step after a load starts from the loaded weights, not the initial ones."""
    run = _run("llama", ["--bf16", "--load", root, "--no-load-optim", "--lr", "0", "--weight-decay", "0"])
    trainer = Trainer(run, torch.device("cpu"))
    load_checkpoint(checkpoint_to_load(run), trainer, run.checkpoint)
    loaded = _weights(trainer)
    trainer.train_step(1)
    return all(torch.equal(w, loaded[n]) for n, w in _weights(trainer).items())


def _save_twice(rank: int, root: str) -> None:
    trainer = Trainer(_run("llama", ["--tensor-model-parallel-size", "2"]), torch.device("cpu"))
    save_checkpoint(root, 1, trainer)
    _randomize(trainer)
    save_checkpoint(root, 2, trainer)


def _crash_during_save(rank: int, root: str) -> None:
    trainer = Trainer(_run("llama", ["--tensor-model-parallel-size", "2"]), torch.device("cpu"))
    original = canonical.publish_checkpoint

    def crash(*args):
        raise RuntimeError("simulated crash")

    canonical.publish_checkpoint = crash  # every rank's files written, nothing published
    try:
        save_checkpoint(root, 3, trainer)
    except RuntimeError:
        pass
    finally:
        canonical.publish_checkpoint = original


def _crash_at_rename(rank: int, root: str) -> None:
    """A crash at the moment the finished directory is renamed: the tracker must not name it yet."""
    trainer = Trainer(_run("llama", ["--tensor-model-parallel-size", "2"]), torch.device("cpu"))
    original = os.replace

    def crash(src, dst):
        if os.path.isdir(src) and src.endswith(".tmp"):
            raise RuntimeError("simulated crash at the directory rename")
        original(src, dst)

    canonical.os.replace = crash
    try:
        save_checkpoint(root, 4, trainer)
    except RuntimeError:  # only rank 0 renames: it meets the others at the save's closing barrier
        dist.barrier()
    finally:
        canonical.os.replace = original


def _load_error(rank: int, root: str, extra: list[str]) -> str | None:
    try:
        run = _run("llama", ["--tensor-model-parallel-size", "2", "--load", root, "--no-load-optim"] + extra)
        info = checkpoint_to_load(run)
        load_checkpoint(info, Trainer(run, torch.device("cpu")), run.checkpoint)
    except CheckpointError as error:
        return str(error)
    return None


def _error(root: str, extra: list[str] = ()) -> str:
    errors = run_distributed(2, _load_error, root, list(extra))
    assert errors[0] == errors[1] and errors[0] is not None and "\n" not in errors[0], errors
    return errors[0]


def test_bad_checkpoints_stop_with_one_line_and_the_previous_one_survives(tmp_path):
    root = str(tmp_path / "ckpt")
    run_distributed(2, _save_twice, root)
    latest = os.path.join(root, "iter_0000002")
    assert run_distributed(2, _load_error, root, [])[0] is None
    assert run_distributed(1, _bf16_master_weights, root)[0], "bf16 master weights must follow the loaded model"

    run_distributed(2, _crash_during_save, root)  # the tracker still names iteration 2, which loads
    assert Path(root, "latest_checkpointed_iteration.txt").read_text() == "2"
    assert os.path.isdir(os.path.join(root, "iter_0000003.tmp"))
    assert run_distributed(2, _load_error, root, [])[0] is None
    run_distributed(2, _crash_at_rename, root)  # the tracker is written only after the rename
    assert Path(root, "latest_checkpointed_iteration.txt").read_text() == "2"
    assert run_distributed(2, _load_error, root, [])[0] is None

    assert "--hidden-size 64, the flags give 32" in _error(root, ["--hidden-size", "32", "--num-attention-heads", "4"])
    assert "--num-layers 4, the flags give 2" in _error(root, ["--num-layers", "2"])
    shard = os.path.join(latest, "__1_0.distcp")
    backup = shard + ".bak"
    shutil.copy(shard, backup)
    with open(shard, "r+b") as handle:
        handle.truncate(os.path.getsize(shard) // 2)
    truncated = _error(root)
    assert truncated.startswith(f"{shard}: ") and "truncated" in truncated
    os.remove(shard)
    assert f"{shard}: shard file missing" == _error(root)
    shutil.move(backup, shard)
    with open(shard, "r+b") as handle:
        handle.seek(100)
        byte = handle.read(1)
        handle.seek(100)
        handle.write(bytes([byte[0] ^ 0xFF]))
    assert "CRC32 differs" in _error(root)

    # the previous checkpoint still loads once the tracker names it
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write("1")
    assert run_distributed(2, _load_error, root, [])[0] is None
    metadata = os.path.join(root, "iter_0000001", "metadata.json")
    record = json.loads(Path(metadata).read_text())
    record["contents"].remove("optimizer")  # as a converted model
    Path(metadata).write_text(json.dumps(record))
    assert "holds no optimizer state; pass --no-load-optim" in _refusal(root, [])


def _refusal(root: str, extra: list[str]) -> str:
    """The one line refusing `root` before any process group exists."""
    defaults, argv = model_flags("llama", ["--load", root] + extra)
    with pytest.raises(CheckpointError) as error:
        checkpoint_to_load(parse_run_config(argv, defaults, 1))
    return str(error.value)


def _fresh_start_note(root: str) -> str:
    """checkpoint_to_load finds nothing in `root` (a first launch): the one note line it adds."""
    defaults, argv = model_flags("llama", ["--load", root])
    run = parse_run_config(argv, defaults, 1)
    before = list(run.notes)
    assert checkpoint_to_load(run) is None
    (note,) = [line for line in run.notes if line not in before]
    return note


def test_first_launch_with_save_and_load_of_one_new_directory_starts_fresh(tmp_path):
    """Megatron-LM's scripts pass one directory to --save and --load from the first launch on."""
    missing = str(tmp_path / "ckpt")
    assert _fresh_start_note(missing) == (
        f"> note: --load {missing} does not exist yet: no checkpoint found, training starts from scratch"
    )
    os.makedirs(missing)
    open(os.path.join(missing, "train.log"), "w").close()  # a log beside nothing that looks like a checkpoint
    assert "holds no latest_checkpointed_iteration.txt" in _fresh_start_note(missing)


@pytest.mark.parametrize(
    "files, found",
    [
        (["metadata.json", ".metadata", "__0_0.distcp", "common.pt"], "single checkpoint directory (metadata.json)"),
        (["common.pt", "__0_0.distcp"], "Megatron-LM torch_dist checkpoint directory (common.pt)"),
        (["__0_0.distcp"], "__0_0.distcp, which looks like saved model weights"),
        (["config.json", "model.safetensors"], "a Hugging Face model (config.json)"),
        (["mp_rank_00"], "mp_rank_00, which looks like saved model weights"),
        (["iter_0000002"], "iter_* directories (iter_0000002) but no latest_checkpointed_iteration.txt"),
    ],
)
def test_load_never_ignores_files_that_look_like_a_checkpoint(tmp_path, files, found):
    for name in files:
        open(tmp_path / name, "w").close()
    message = _refusal(str(tmp_path), [])
    assert message.startswith(f"--load {tmp_path}: holds ") and found in message, message
    assert "\n" not in message


def test_load_of_a_file_or_a_megatron_tracker_is_refused(tmp_path):
    file = tmp_path / "model.pt"
    file.write_bytes(b"x")
    assert _refusal(str(file), []) == f"--load {file}: is a file; pass the directory given to --save"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    os.makedirs(tmp_path / "iter_0000005")
    (tmp_path / "iter_0000005" / "metadata.json").write_text(
        json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
    )
    with pytest.raises(CheckpointError) as error:  # our format's reader; --load reads it as Megatron-LM's
        canonical.find_checkpoint(str(tmp_path))
    assert "a Megatron-LM torch_dist checkpoint" in str(error.value)


def _signal_control(rank: int, root: str) -> tuple:
    saved = []
    control = RunControl(CheckpointConfig(save=root, exit_signal_handler=True), saved.append, torch.device("cpu"))

    def after(iteration):
        reason = control.stop_reason(iteration)
        control.save_if_due(iteration, 10, reason)
        return reason

    first = after(1)
    if rank == 0:
        os.kill(os.getpid(), signal.SIGTERM)
    second = after(2)
    return first, second, saved


def test_sigterm_on_one_rank_stops_all_ranks_after_saving(tmp_path):
    results = run_distributed(2, _signal_control, str(tmp_path))
    assert all(r == (None, "SIGTERM received (--exit-signal-handler)", [2]) for r in results), results


def _pretrain(*flags) -> subprocess.CompletedProcess:
    argv = [
        sys.executable,
        str(ROOT / "pretrain_llama.py"),
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--mock-data",
        "--vocab-size",
        "64",
        "--log-interval",
        "1",
        *flags,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_cli_saves_exits_resumes_and_refuses(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = _pretrain("--train-iters", "6", "--save", ckpt, "--save-interval", "2", "--exit-interval", "3")
    assert first.returncode == 0, first.stderr
    assert "exiting after iteration 3: --exit-interval 3 reached" in first.stdout
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]
    resumed = _pretrain("--train-iters", "4", "--load", ckpt, "--save", ckpt, "--async-save")
    assert resumed.returncode == 0, resumed.stderr
    assert f"> saving {ckpt}/iter_0000004.tmp in the background" in resumed.stdout
    assert f"> saved {ckpt}/iter_0000004 (written in the background)" in resumed.stdout
    assert "iteration        4/       4" in resumed.stdout and "iteration        3/" not in resumed.stdout
    assert Path(ckpt, "latest_checkpointed_iteration.txt").read_text() == "4"
    refused = _pretrain("--train-iters", "4", "--load", ckpt, "--no-load-optim", "--num-layers", "4")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"error: {ckpt}/iter_0000004: saved with --num-layers 2, the flags give 4"
    ]
    first_launch = str(tmp_path / "new")
    fresh = _pretrain("--train-iters", "1", "--load", first_launch, "--save", first_launch)
    assert fresh.returncode == 0, fresh.stderr
    assert f"> note: --load {first_launch} does not exist yet: no checkpoint found" in fresh.stdout
    assert sorted(os.listdir(first_launch)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ckpt-format", "torch"], "--ckpt-format torch"),
        (["--async-save"], "--async-save needs --save"),
        (["--exit-interval", "0"], "--exit-interval must be > 0"),
    ],
)
def test_checkpoint_flags_are_validated(flags, message):
    defaults, argv = model_flags("llama", flags)
    with pytest.raises(ValueError, match=message):
        parse_run_config(argv, defaults, 1)


def test_save_interval_without_save_is_accepted_with_a_note():
    """As Megatron-LM does (a smoke test of a launch script): nothing is saved, and start-up says so."""
    defaults, argv = model_flags("llama", ["--save-interval", "5"])
    run = parse_run_config(argv, defaults, 1)
    assert run.checkpoint.save is None
    assert "> note: --save-interval 5 without --save: no checkpoint will be saved" in run.notes
