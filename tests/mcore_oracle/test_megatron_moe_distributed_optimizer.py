"""Megatron-LM's distributed-optimizer checkpoint (`dp_reshardable` buckets) of MoE models, both ways, checked
against megatron-core itself.

megatron-core 0.16.1 (tests/mcore_oracle/driver.py, two gloo ranks, its DistributedOptimizer) trains MoE GPTModels
(local spec, SequentialMLP experts; no auxiliary loss, see test_megatron_moe_checkpoint.py) for 2 steps, saves
torch_dist as Megatron-LM saves it and trains 3 more steps: the Mixtral-like model at expert-parallel size 1 (dp 2:
the experts sit in the dense buffer) and 2 (a ChainedOptimizer: the dense buffer sharded over dp 2, the experts'
buffers, one per ep rank, over expert-dp 1), and the DeepSeek-like one (a dense first layer, a shared expert,
expert bias) at EP2. We load each checkpoint at EP2 and at EP1 x DP2 with --use-distributed-optimizer: steps 3-5
give megatron-core's losses and grad norms. Both our runs then save `--ckpt-format torch_dist` after step 5 and take
steps 6-7; megatron-core loads each save at the expert-parallel size it was written at (its dp_reshardable form
reshards dp only) and its steps 6-7 are ours. All within 1e-5 (as the dense models' test).
"""

from __future__ import annotations

import json
import os

import torch

from megatron.core.checkpointing.megatron_buckets import bucket_layout, megatron_parameter_order
from megatron.training.checkpoint.torch_dist import save_megatron_checkpoint
from tests.distributed import run_distributed
from tests.mcore_oracle.oracle import megatron_core_python, run_oracle
from tests.mcore_oracle.test_megatron_core import _close, _load, _train, write_batch
from tests.mcore_oracle.test_megatron_moe_checkpoint import CASES, EP, _moe_job

SAVED = (("mixtral", 1), ("mixtral", 2), ("deepseek", 2))  # (model, expert-parallel size) megatron-core saves
DISTRIBUTED = ["--use-distributed-optimizer"]


def _ours(rank: int, directory: str, batch_file: str, ep: int) -> dict:
    """Steps 3-5 from each megatron-core checkpoint at expert-parallel size `ep` (2 ranks), then (from the
    Mixtral one saved at the same size) our torch_dist save after step 5 and steps 6-7."""
    batch = torch.load(batch_file)
    results = {}
    for case, saved_ep in SAVED:
        root = os.path.join(directory, f"mcore_{case}_ep{saved_ep}")
        trainer, iteration = _load("llama", "tp1", root, batch, CASES[case] + EP[ep] + DISTRIBUTED)
        results[(case, saved_ep)] = _train(trainer, iteration + 1, 5)
        if (case, saved_ep) == ("mixtral", ep):
            save_megatron_checkpoint(os.path.join(directory, f"ours_{case}_ep{ep}"), 5, trainer)
            results["steps 6-7"] = _train(trainer, 6, 7)
    return results


def _check_layout(buffers: list[dict], ep: int, what: str) -> None:
    """Our pure layout places every parameter where megatron-core's buffers of rank 0 do: at EP1 one buffer (the
    experts inline, after the router), at EP2 the dense one (dp 2) and ep rank 0's experts' (expert-dp 1)."""
    assert len(buffers) == (1 if ep == 1 else 2), what
    for buffer, dp in zip(buffers, (2, 1)):
        sizes = {name: stop - start for name, start, stop, _ in buffer["params"]}
        buckets = bucket_layout([(name, sizes[name]) for name in megatron_parameter_order(sizes)], dp_size=dp)
        ours = {name: span for bucket in buckets for name, span in bucket.params.items()}
        assert ours == {name: (start, stop) for name, start, stop, _ in buffer["params"]}, what
        assert [[b.numel, b.numel_unpadded] for b in buckets] == [[n, u] for _, n, u in buffer["buckets"]], what


def _check(ours: dict, theirs: dict, what: str) -> None:
    for key in ("loss", "grad_norm"):
        print(f"{what} {key}: max abs diff {max(abs(a - b) for a, b in zip(ours[key], theirs[key])):.2e}")
        _close(ours[key], theirs[key], f"{what} {key}")


def test_megatron_core_moe_distributed_optimizer_checkpoints_in_our_layouts_and_back(tmp_path):
    megatron_core_python()
    batch = write_batch(tmp_path)
    jobs = [
        _moe_job(
            case,
            ep,
            batch,
            [
                {"op": "buffers", "out": str(tmp_path / f"mcore_{case}_ep{ep}_buffers.json")},
                {"op": "train", "iters": 2, "out": str(tmp_path / f"mcore_{case}_ep{ep}_steps_1_2.json")},
                {"op": "save", "root": str(tmp_path / f"mcore_{case}_ep{ep}"), "iteration": 2},
                {"op": "train", "iters": 3, "out": str(tmp_path / f"mcore_{case}_ep{ep}_steps_3_5.json")},
            ],
        )
        | {"distributed_optimizer": True}
        for case, ep in SAVED
    ]
    run_oracle(jobs, tmp_path)
    for case, ep in SAVED:
        _check_layout(json.loads((tmp_path / f"mcore_{case}_ep{ep}_buffers.json").read_text()), ep, f"{case} EP{ep}")
    ours = {ep: run_distributed(2, _ours, str(tmp_path), batch, ep)[0] for ep in EP}
    for case, saved_ep in SAVED:
        theirs = json.loads((tmp_path / f"mcore_{case}_ep{saved_ep}_steps_3_5.json").read_text())
        for ep in EP:
            what = f"{case} saved by megatron-core at EP{saved_ep}, loaded at our EP{ep} x DP{2 // ep}: steps 3-5"
            _check(ours[ep][(case, saved_ep)], theirs, what)
    jobs = [
        _moe_job(
            "mixtral",
            ep,
            batch,
            [
                {"op": "load", "root": str(tmp_path / f"ours_mixtral_ep{ep}"), "optimizer": True},
                {"op": "train", "iters": 2, "out": str(tmp_path / f"ours_mixtral_ep{ep}_in_mcore.json")},
            ],
        )
        | {"distributed_optimizer": True}
        for ep in EP
    ]
    run_oracle(jobs, tmp_path)
    for ep in EP:
        theirs = json.loads((tmp_path / f"ours_mixtral_ep{ep}_in_mcore.json").read_text())
        _check(
            ours[ep]["steps 6-7"],
            theirs,
            f"mixtral saved by us at EP{ep}, loaded by megatron-core at EP{ep}: steps 6-7",
        )
