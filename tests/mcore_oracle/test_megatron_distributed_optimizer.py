"""Megatron-LM's default distributed-optimizer checkpoint (`dp_reshardable` buckets), checked against
megatron-core itself.

megatron-core 0.16.1 (tests/mcore_oracle/driver.py) trains a Llama-style GPTModel with its
DistributedOptimizer for 2 steps at tp 1 x dp 2 and at tp 2 x dp 1, saves it as Megatron-LM saves
it (`dp_reshardable`; at tp 1 also `fully_reshardable`), and trains 3 more steps; a tied GPT with
biases does the same at tp 1 x dp 2 with small gradient buckets (several buckets). We load those
checkpoints at DP1, DP2 (distributed optimizer, optim_grads, optim_grads_params) and TP2 x DP2, and
steps 3-5 give megatron-core's losses and grad norms within 1e-5. Our DP2 and TP2 x DP2 runs then
save `--ckpt-format torch_dist` with the distributed optimizer; megatron-core loads them (at tp 1 x
dp 2 and tp 2 x dp 1: it reshards dp) and its steps 6-7 give our losses and grad norms. Our pure
bucket layout equals megatron-core's buffers, and a checkpoint whose buckets do not match the flags'
model is refused with one line.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from megatron.core.checkpointing import CheckpointError
from megatron.core.checkpointing.megatron_buckets import bucket_layout, megatron_parameter_order
from megatron.training.checkpoint import checkpoint_to_load, load_checkpoint
from megatron.training.checkpoint.torch_dist import save_megatron_checkpoint
from megatron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.mcore_oracle.oracle import megatron_core_python, run_oracle
from tests.mcore_oracle.test_megatron_core import _close, _feed, _job, _run, _train, write_batch

BUCKET_SIZE = 2000  # elements: the GPT's parameters then fill several buckets
SAVED = {  # case -> (model, tp, megatron-core job options)
    "llama_tp1": ("llama", 1, {}),
    "llama_tp2": ("llama", 2, {}),
    "gpt_buckets": ("gpt", 1, {"bucket_size": BUCKET_SIZE}),
}
OUR_LAYOUTS = {  # name -> (world, flags)
    "dp1": (1, []),
    "dp2": (2, ["--use-distributed-optimizer"]),
    "dp2_optim_grads": (2, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]),
    "dp2_optim_grads_params": (2, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]),
    "tp2_dp2": (4, ["--use-distributed-optimizer", "--tensor-model-parallel-size", "2"]),
}
WRITERS = {"dp2": 1, "tp2_dp2": 2}  # our layouts that save torch_dist -> the tp megatron-core loads them at


@pytest.fixture(scope="module")
def saved_by_megatron_core(tmp_path_factory):
    megatron_core_python()
    directory = tmp_path_factory.mktemp("mcore_distopt")
    batch = write_batch(directory)
    jobs = []
    for case, (model, tp, options) in SAVED.items():
        out = directory / case
        ops = [
            {"op": "buffers", "out": str(out / "buffers.json")},
            {"op": "train", "iters": 2, "out": str(out / "steps_1_2.json")},
            {"op": "save", "root": str(out / "dp_reshardable"), "iteration": 2},
        ]
        if case == "llama_tp1":
            ops.append(
                {"op": "save", "root": str(out / "fully_reshardable"), "iteration": 2, "sharding": "fully_reshardable"}
            )
        ops.append({"op": "train", "iters": 3, "out": str(out / "steps_3_5.json")})
        jobs.append({**_job(model, tp, batch, ops), "distributed_optimizer": True, **options})
    run_oracle(jobs, directory)
    return directory, batch


def _checkpoints(directory: str) -> dict[str, tuple[str, str]]:
    """Case -> (model, checkpoint root) of megatron-core's saves."""
    roots = {case: (model, os.path.join(directory, case, "dp_reshardable")) for case, (model, _, _) in SAVED.items()}
    roots["llama_tp1_fully_reshardable"] = ("llama", os.path.join(directory, "llama_tp1", "fully_reshardable"))
    return roots


def _refusal(directory: str) -> str:
    """The line refusing the llama checkpoint when its `args` claim gradient buckets of 1000 elements (as
    --overlap-grad-reduce --ddp-bucket-size 1000 would build; the tensors hold one bucket)."""
    run = _run("llama", ["--load", os.path.join(directory, "llama_tp1", "dp_reshardable")], 1)
    info = checkpoint_to_load(run)
    info.metadata["megatron_args"].overlap_grad_reduce = True
    info.metadata["megatron_args"].ddp_bucket_size = 1000
    try:
        load_checkpoint(info, Trainer(run, torch.device("cpu")), run.checkpoint)
    except CheckpointError as error:
        return str(error)
    return "not refused"


def _ours(rank: int, directory: str, batch_file: str, layout: str) -> dict:
    """Steps 3-5 from every megatron-core checkpoint in `layout`, then (WRITERS) a torch_dist save after
    step 5 and steps 6-7."""
    batch = torch.load(batch_file)
    flags = OUR_LAYOUTS[layout][1]
    results = {}
    for case, (model, root) in _checkpoints(directory).items():
        if layout.startswith("tp2") and model == "gpt":
            continue  # the tied GPT's 4 heads split at tp 2 too, but one tp2 case is enough here
        trainer, iteration = _load_with_flags(model, root, batch, flags)
        results[case] = _train(trainer, iteration + 1, 5)
        if case == "llama_tp1" and layout in WRITERS:
            save_megatron_checkpoint(os.path.join(directory, f"ours_{layout}"), 5, trainer)
            results["steps 6-7"] = _train(trainer, 6, 7)
    if layout == "dp1":
        results["refusal"] = _refusal(directory)
    return results


def _load_with_flags(model: str, root: str, batch: dict, flags: list[str]):
    run = _run(model, flags + ["--load", root], dist.get_world_size())
    trainer = Trainer(run, torch.device("cpu"))
    iteration, _ = load_checkpoint(checkpoint_to_load(run), trainer, run.checkpoint)
    _feed(trainer, batch)
    return trainer, iteration


def test_bucket_layout_is_megatron_cores(saved_by_megatron_core):
    """Our pure layout (parameter order, 64-element alignment, bucket closing and padding) places every
    parameter where megatron-core's buffers do (dp 2: Llama in one bucket, GPT in several)."""
    directory, _ = saved_by_megatron_core
    for case in SAVED:
        (buffer,) = json.loads((directory / case / "buffers.json").read_text())
        theirs = {name: (start, stop) for name, start, stop, _ in buffer["params"]}
        sizes = {name: stop - start for name, (start, stop) in theirs.items()}
        buckets = bucket_layout(
            [(name, sizes[name]) for name in megatron_parameter_order(sizes)],
            dp_size=2,
            bucket_size=SAVED[case][2].get("bucket_size"),
        )
        offset, ours = 0, {}
        for bucket in buckets:
            ours.update({name: (offset + a, offset + b) for name, (a, b) in bucket.params.items()})
            offset += bucket.numel
        assert ours == theirs, case
        assert [[b.numel, b.numel_unpadded] for b in buckets] == [[n, u] for _, n, u in buffer["buckets"]], case
    assert len(json.loads((directory / "gpt_buckets" / "buffers.json").read_text())[0]["buckets"]) > 1


def test_megatron_core_distributed_optimizer_checkpoints_in_our_layouts_and_back(saved_by_megatron_core):
    directory, batch_file = saved_by_megatron_core
    results = {
        layout: run_distributed(world, _ours, str(directory), batch_file, layout)[-1]
        for layout, (world, _) in OUR_LAYOUTS.items()
    }
    for layout, ours in results.items():
        for case in _checkpoints(str(directory)):
            if case not in ours:
                continue
            saved = directory / case.removesuffix("_fully_reshardable")
            theirs = json.loads((saved / "steps_3_5.json").read_text())
            for key in ("loss", "grad_norm"):
                _close(ours[case][key], theirs[key], f"{case} loaded at {layout}: steps 3-5 {key}")
    refusal = results["dp1"]["refusal"]
    assert ".metadata: the distributed optimizer's buckets of dp_group_idx_0 hold [" in refusal, refusal
    assert "megatron-core's layout of the flags' model" in refusal and "\n" not in refusal, refusal
    jobs = [
        {
            **_job(
                "llama",
                tp,
                batch_file,
                [
                    {"op": "load", "root": str(directory / f"ours_{layout}"), "optimizer": True},
                    {"op": "train", "iters": 2, "out": str(directory / f"ours_{layout}_steps_6_7.json")},
                ],
            ),
            "distributed_optimizer": True,
        }
        for layout, tp in WRITERS.items()
    ]
    run_oracle(jobs, directory)
    for layout in WRITERS:
        theirs = json.loads((directory / f"ours_{layout}_steps_6_7.json").read_text())
        for key in ("loss", "grad_norm"):
            _close(
                results[layout]["steps 6-7"][key], theirs[key], f"our {layout} torch_dist save in megatron-core: {key}"
            )
