#!/usr/bin/env python
"""Checkpoint save and load: our formats vs megatron-core's dist_checkpointing and torch.save, side by side.

    python tools/bench/checkpoint.py [--repeat 5] [--ranks 1,2,4] [--dir /tmp]

A Llama of ~27M parameters (fp32 weights; with the optimizer's two Adam moments ~330 MB of state) on
1, 2 and 4 CPU gloo ranks (tensor parallel, so each rank holds 1/n). Ours: `save_checkpoint` (every
rank writes its canonical pieces through torch.distributed.checkpoint with their CRC-32s, then
metadata, rename) and `load_checkpoint` (verify every file, then read model and optimizer state; the
CRC-32 check alone is shown as "verify"). Baseline: every rank `torch.save`s its own parameters and
optimizer tensors into one file (Megatron's per-rank `torch` format, bound to the layout), fsynced
as ours is, and loads them back with `torch.load` + copy. Ours in Megatron-LM's format:
`--ckpt-format torch_dist`'s save (no digests: Megatron-LM records none) and our load of it (file
lengths checked against `.metadata`, then read). megatron-core 0.16.1 (its own environment,
tests/mcore_oracle/driver.py, skipped when it cannot be installed): the same model built as its
GPTModel on the same ranks, after one AdamW step, `dist_checkpointing.save` of model + optimizer +
common state as Megatron-LM's save_checkpoint passes it, and `dist_checkpointing.load` + the model's
and optimizer's load_state_dict. Each round times all of them, megatron-core's save and load taking
their turn after ours (its processes wait meanwhile), so that a change in the machine's load
affects every side alike. Every save writes where nothing is (the previous round's files are
removed before the timer starts, as a save of a new iteration finds them). Times are the slowest
rank's, the median of `--repeat` rounds; loads read from the page cache (the files were just written).

Then the training loop's blocked time: `--loop-iterations` iterations of the same model on
`--loop-ranks` ranks, saving every `--loop-interval` through `CheckpointSaver` as pretrain does
(poll, save when due, wait for a pending save at the end), synchronously and with --async-save.
Blocked: the time the loop spends in those calls (async: the host copy, finalizing, and waiting
when a write is not done yet); loop: the whole loop, training steps included (the background
writer competes with training for the CPU cores). Slowest rank, median of `--repeat` rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.core.checkpointing import verify_files  # noqa: E402
from megatron.core.transformer.model_fields import model_record  # noqa: E402
from megatron.training.arguments.parser import LLAMA_DEFAULTS, parse_run_config  # noqa: E402
from megatron.training.checkpoint import (  # noqa: E402
    CheckpointSaver,
    checkpoint_to_load,
    load_checkpoint,
    save_checkpoint,
)
from megatron.training.checkpoint.torch_dist import save_megatron_checkpoint  # noqa: E402
from megatron.training.trainer import Trainer  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

FLAGS = [
    "--num-layers",
    "6",
    "--hidden-size",
    "512",
    "--num-attention-heads",
    "8",
    "--ffn-hidden-size",
    "1408",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "1",
    "--train-iters",
    "10",
    "--mock-data",
    "--vocab-size",
    "8000",
]


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def _timed(fn, *args) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn(*args)
    return _slowest(time.perf_counter() - start)


def _bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _rank_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """What the torch.save baseline writes: this rank's parameters and optimizer tensors."""
    state = {name: p.detach() for chunk in trainer.chunks for name, p in chunk.module.named_parameters()}
    state.update({f"optimizer.{i}": t for i, t in enumerate(trainer.optimizer.adam.state_tensors())})
    return state


def _durable_torch_save(state: dict, path: str) -> None:
    """torch.save, then fsync as our save does (DCP syncs each file): the file is on disk when it returns."""
    with open(path, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


class Turns:
    """Rounds taken in turn with megatron-core's (driver.py time_checkpoint's "turns"): round i starts once
    megatron-core has written mcore_<i> (ready, or its round i - 1 done) and ends writing ours_<i>. Without
    a directory, or once it holds `stop` (megatron-core could not run), there is no one to wait for."""

    def __init__(self, directory: str | None):
        self.directory = directory

    def wait(self, i: int) -> None:
        while self.directory is not None and not os.path.exists(os.path.join(self.directory, f"mcore_{i}")):
            if os.path.exists(os.path.join(self.directory, "stop")):
                self.directory = None
                return
            time.sleep(0.01)

    def done(self, i: int) -> None:
        dist.barrier()
        if self.directory is not None and dist.get_rank() == 0:
            Path(self.directory, f"ours_{i}").touch()


def measure(rank: int, root: str, repeat: int, turns: str | None) -> dict:
    world = dist.get_world_size()
    ours, baseline = os.path.join(root, f"ours_{world}"), os.path.join(root, f"torch_{world}")
    run = parse_run_config(FLAGS + ["--tensor-model-parallel-size", str(world), "--load", ours], LLAMA_DEFAULTS, world)
    trainer = Trainer(run, torch.device("cpu"))
    state = _rank_state(trainer)
    own = os.path.join(baseline, f"rank_{rank}.pt")
    if rank == 0:
        os.makedirs(ours, exist_ok=True)
        os.makedirs(baseline, exist_ok=True)
    megatron = os.path.join(root, f"torch_dist_{world}")
    megatron_run = parse_run_config(
        FLAGS + ["--tensor-model-parallel-size", str(world), "--load", megatron], LLAMA_DEFAULTS, world
    )
    times = {"save": [], "load": [], "verify": [], "torch_save": [], "torch_load": [], "td_save": [], "td_load": []}
    turns = Turns(turns)
    for i in range(repeat):
        turns.wait(i)
        if rank == 0:
            _remove(os.path.join(ours, "iter_0000001"))
            _remove(os.path.join(megatron, "iter_0000001"))
        _remove(own)
        times["save"].append(_timed(save_checkpoint, ours, 1, trainer))
        info = checkpoint_to_load(run)
        times["load"].append(_timed(load_checkpoint, info, trainer, run.checkpoint))
        times["verify"].append(_timed(verify_files, info.directory, info.metadata["files"]))
        times["torch_save"].append(_timed(_durable_torch_save, state, own))

        def torch_load():
            for name, tensor in torch.load(own, weights_only=True).items():
                state[name].copy_(tensor)

        times["torch_load"].append(_timed(torch_load))
        times["td_save"].append(_timed(save_megatron_checkpoint, megatron, 1, trainer))

        # the load includes finding the checkpoint (which checks the file lengths), as a resume does
        def megatron_load():
            info = checkpoint_to_load(megatron_run)
            load_checkpoint(info, trainer, megatron_run.checkpoint)

        times["td_load"].append(_timed(megatron_load))
        turns.done(i)
    turns.wait(repeat)  # megatron-core's last round: this side idle meanwhile
    return {
        "times": {key: statistics.median(values) for key, values in times.items()},
        "bytes": _bytes(ours),
        "torch_bytes": _bytes(baseline),
        "td_bytes": _bytes(megatron),
    }


def measure_megatron_core(world: int, root: str, repeat: int, turns: str) -> dict | None:
    """megatron-core's save and load of the same model on `world` ranks, the median of `repeat` rounds
    taken in turn with ours (None: it cannot be installed; then `turns` gets `stop`)."""
    import pytest

    from tests.mcore_oracle.oracle import run_oracle

    config = parse_run_config(FLAGS, LLAMA_DEFAULTS, 1).model
    directory = Path(root) / f"mcore_{world}"
    directory.mkdir()
    torch.save(
        {
            "tokens": torch.randint(0, config.vocab_size, (1, config.seq_length)),
            "labels": torch.randint(0, config.vocab_size, (1, config.seq_length)),
        },
        directory / "batch.pt",
    )
    job = {
        "tp": world,
        "model": model_record(config),
        "make_vocab_size_divisible_by": config.make_vocab_size_divisible_by,
        "seed": 1,
        "batch": str(directory / "batch.pt"),
        "global_batch_size": 1,
        "optimizer": {},
        "ops": [
            {"op": "train", "iters": 1, "out": str(directory / "train.json")},
            {
                "op": "time_checkpoint",
                "root": str(directory / "ckpt"),
                "repeat": repeat,
                "out": str(directory / "times.json"),
                "turns": turns,
            },
        ],
    }
    try:
        run_oracle([job], directory, world=world)
    except pytest.skip.Exception as reason:
        print(f"megatron-core rows skipped: {reason}")
        return None
    finally:
        Path(turns, "stop").touch()  # ours no longer waits (megatron-core is done, or failed)
    times = json.loads((directory / "times.json").read_text())
    return {key: statistics.median(times[key]) for key in ("save", "load")} | {"bytes": times["bytes"]}


def measure_side_by_side(world: int, root: str, repeat: int, megatron_core: bool) -> tuple[dict, dict | None]:
    """(ours, megatron-core's or None) on `world` ranks, megatron-core's rounds taken in turn with ours."""
    if not megatron_core:
        return run_distributed(world, measure, root, repeat, None)[0], None
    turns = os.path.join(root, f"turns_{world}")
    os.makedirs(turns)
    mcore = {}

    def run_megatron_core() -> None:
        try:
            mcore["times"] = measure_megatron_core(world, root, repeat, turns)
        except BaseException as error:  # noqa: BLE001 - reported below, once ours has finished
            mcore["error"] = error

    thread = threading.Thread(target=run_megatron_core)
    thread.start()
    try:
        ours = run_distributed(world, measure, root, repeat, turns)[0]
    finally:
        Path(turns, "stop").touch()  # megatron-core's driver stops waiting if ours failed
        thread.join()
    if "error" in mcore:
        raise mcore["error"]
    return ours, mcore["times"]


def measure_loop(rank: int, root: str, iterations: int, interval: int, repeat: int) -> dict:
    """{mode: (blocked seconds, loop seconds)} for synchronous and asynchronous saves."""
    world = dist.get_world_size()
    out = {}
    for mode in ("sync", "async"):
        directory = os.path.join(root, f"loop_{mode}_{world}")
        run = parse_run_config(FLAGS + ["--tensor-model-parallel-size", str(world)], LLAMA_DEFAULTS, world)
        trainer = Trainer(run, torch.device("cpu"))
        saver = CheckpointSaver(directory, trainer, lambda line: None, asynchronous=mode == "async")
        rounds = []
        for _ in range(repeat):
            if dist.get_rank() == 0:
                _remove(directory)
            dist.barrier()
            blocked, start = 0.0, time.perf_counter()
            for iteration in range(1, iterations + 1):
                trainer.train_step(iteration)
                began = time.perf_counter()
                saver.poll()
                if iteration % interval == 0:
                    saver.save(iteration)
                blocked += time.perf_counter() - began
            began = time.perf_counter()
            saver.finish()
            blocked += time.perf_counter() - began
            loop = time.perf_counter() - start
            rounds.append((_slowest(blocked), _slowest(loop)))
        out[mode] = tuple(statistics.median(column) for column in zip(*rounds))
        trainer.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--ranks", default="1,2,4", help="rank counts of the save/load rows (default 1,2,4)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--loop-only", action="store_true", help="only the training loop's blocked time")
    parser.add_argument("--no-megatron-core", action="store_true", help="leave out megatron-core's rows")
    parser.add_argument("--no-loop", action="store_true", help="leave out the training loop's blocked time")
    parser.add_argument("--loop-ranks", type=int, default=2)
    parser.add_argument("--loop-iterations", type=int, default=8)
    parser.add_argument("--loop-interval", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir)
    try:
        rows, peers = [], []
        for world in () if args.loop_only else [int(n) for n in args.ranks.split(",")]:
            r, mcore = measure_side_by_side(world, root, args.repeat, not args.no_megatron_core)
            t = r["times"]
            rows.append(
                (
                    world,
                    r["bytes"] / 1e6,
                    r["torch_bytes"] / 1e6,
                    t["save"],
                    t["torch_save"],
                    t["save"] / t["torch_save"],
                    t["load"],
                    t["verify"],
                    t["torch_load"],
                    t["load"] / t["torch_load"],
                )
            )
            peers.append((world, t, r["td_bytes"], mcore))
        if not args.no_loop:
            loop = run_distributed(
                args.loop_ranks, measure_loop, root, args.loop_iterations, args.loop_interval, args.repeat
            )[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if rows:
        print(
            f"checkpoint save/load, Llama {FLAGS[3]} hidden x {FLAGS[1]} layers, fp32 weights + Adam moments, "
            f"tensor parallel over n CPU gloo ranks; slowest rank, median of {args.repeat} rounds"
        )
        print(
            f"{'ranks':>5} {'MB ours':>8} {'MB torch':>8} {'save s':>7} {'torch.save s':>12} {'ratio':>6} "
            f"{'load s':>7} {'(verify s)':>10} {'torch.load s':>12} {'ratio':>6}"
        )
        for world, mb, tmb, save, tsave, sratio, load, verify, tload, lratio in rows:
            print(
                f"{world:>5} {mb:>8.1f} {tmb:>8.1f} {save:>7.2f} {tsave:>12.2f} {sratio:>6.2f} "
                f"{load:>7.2f} {verify:>10.2f} {tload:>12.2f} {lratio:>6.2f}"
            )
        print(
            "side by side with megatron-core (dist_checkpointing, torch_dist) and ours in Megatron-LM's format; "
            "ratios: time / megatron-core's"
        )
        print(
            f"{'ranks':>5} {'MB mcore':>8} {'save s':>7} {'load s':>7} | {'ours save':>9} {'ratio':>6} "
            f"{'ours load':>9} {'ratio':>6} | {'td save':>7} {'ratio':>6} {'td load':>7} {'ratio':>6}"
        )
        for world, t, td_bytes, mcore in peers:
            if mcore is None:
                print(
                    f"{world:>5} {'-':>8} (megatron-core not installed)  ours torch_dist save {t['td_save']:.2f} s, "
                    f"load {t['td_load']:.2f} s, {td_bytes / 1e6:.1f} MB"
                )
                continue
            ms, ml = mcore["save"], mcore["load"]
            print(
                f"{world:>5} {mcore['bytes'] / 1e6:>8.1f} {ms:>7.2f} {ml:>7.2f} | {t['save']:>9.2f} "
                f"{t['save'] / ms:>6.2f} {t['load']:>9.2f} {t['load'] / ml:>6.2f} | {t['td_save']:>7.2f} "
                f"{t['td_save'] / ms:>6.2f} {t['td_load']:>7.2f} {t['td_load'] / ml:>6.2f}"
            )
    if args.no_loop:
        return 0
    saves = args.loop_iterations // args.loop_interval
    print(
        f"training loop, {args.loop_iterations} iterations on {args.loop_ranks} ranks (tensor parallel), "
        f"{saves} saves; slowest rank, median of {args.repeat} rounds"
    )
    print(f"{'':>6} {'blocked s':>9} {'loop s':>7}")
    for mode in ("sync", "async"):
        print(f"{mode:>6} {loop[mode][0]:>9.2f} {loop[mode][1]:>7.2f}")
    print(
        f"blocked time async / sync: {loop['async'][0] / loop['sync'][0]:.2f}; "
        f"loop time async / sync: {loop['async'][1] / loop['sync'][1]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
