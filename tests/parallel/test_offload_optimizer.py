"""The offload optimizer (--optimizer-cpu-offload) reproduces plain AdamW at one rank.

Offload full and half (f = 0.5), static and auto policies, at DP=1, DP=2 and TP=2 (+SP) x PP=2 (v=2)
x DP=2 on 8 ranks, fp32, 8 microbatches, clipping active, small buckets (many chunks, parameters
straddling shards): the lm loss of 5 iterations and the parameters after 5 steps match the
one-process replicated run within 1e-5 relative. fp16 with an inf injected into one rank's
shard skips the step everywhere with host state unchanged. The device and host bytes reported
equal the bytes of the tensors that exist (8 or 12 per element on the device, 16 on host: master,
moments and the gradient copy). Bad input is one line. torchrun with 4 ranks prints the one-rank
losses and the offload accounting line.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron.core.optimizer.offload import placement_bytes
from megatron.planning.estimator import estimate_memory
from megatron.training.arguments.parser import LLAMA_DEFAULTS, parse_run_config
from megatron.training.memory_check import layout_from_run
from tests.cli import TINY_LLAMA, run_cli, torchrun_matching_one_rank
from tests.distributed import run_distributed
from tests.parallel.layouts import assert_final_weights_match, build_trainer, named_params, train
from tests.parallel.test_distributed_optimizer import COMMON, DIST, GATHER, LR, PP2, SP, TP2, VPP

FULL = DIST + ["--optimizer-cpu-offload"]
HALF = FULL + ["--optimizer-offload-fraction", "0.5"]
AUTO = FULL + ["--offload-policy", "auto", "--device-memory-gb", "0.00088"]  # 0.9 MiB: keeps some chunks, not all
MESH8 = TP2 + SP + PP2 + VPP
RUNS = {
    1: {"dp1-full": FULL, "dp1-half": HALF, "dp1-auto": AUTO},
    2: {"dp2-full": FULL + GATHER, "dp2-half": HALF, "dp2-auto": AUTO + GATHER},
    8: {"mesh8-full": FULL + MESH8 + GATHER, "mesh8-half": HALF + MESH8},
}
CASES = [(world, name) for world, runs in RUNS.items() for name in runs]


def train_and_place(rank: int, runs: list) -> list[dict]:
    out = []
    for flags in runs:
        result = train("gpt", flags)
        trainer = build_trainer("gpt", flags)
        trainer.train_step(1)
        adam = trainer.optimizer.adam
        result["host_chunks"] = len(adam.offload.order)
        result["chunks"] = len(trainer.optimizer.shards)
        result["slab_bytes"] = adam.host_memory.slab.untyped_storage().nbytes()
        result["host_elements"] = sum(adam.shards[i].main.numel() for i in adam.offload.order)
        out.append(result)
    return out


@pytest.fixture(scope="module")
def results():
    out = {"reference": run_distributed(1, _reference)[0]}
    for world, runs in RUNS.items():
        per_rank = run_distributed(world, train_and_place, [COMMON + flags for flags in runs.values()])
        for index, name in enumerate(runs):
            out[name] = [rank_results[index] for rank_results in per_rank]
    return out


def _reference(rank: int) -> dict:
    return train("gpt", COMMON)


@pytest.mark.parametrize("world,layout", CASES, ids=[name for _, name in CASES])
def test_offload_matches_one_process(results, world, layout):
    reference = results["reference"]
    assert reference["grad_norms"][0] > 0.3, "clipping must be active"
    for rank, out in enumerate(results[layout]):
        assert_final_weights_match(rank, out, reference, LR)
        host, chunks = out["host_chunks"], out["chunks"]
        if "full" in layout:
            assert host == chunks
        else:  # half, or auto under a budget that holds some chunks but not all
            assert 0 < host < chunks, f"rank {rank}: {host} of {chunks} chunks on host"
        # the host slab holds exactly the chunks offloaded (auto: placed before anything is allocated)
        assert out["slab_bytes"] == 16 * out["host_elements"], (rank, out["slab_bytes"], out["host_elements"])


def _host_state(trainer) -> list[torch.Tensor]:
    adam = trainer.optimizer.adam
    return [t.clone() for i in adam.offload.order for t in (adam.shards[i].main, adam.exp_avg[i], adam.exp_avg_sq[i])]


def check_fp16_inf_skips_everywhere(rank: int) -> None:
    trainer = build_trainer("gpt", FULL + ["--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1"])
    assert not trainer.train_step(1).skipped
    trainer.optimizer.finish_param_sync()
    weights, host = {n: p.detach().clone() for n, p in named_params(trainer)}, _host_state(trainer)
    trainer.forward_backward(2)
    if rank == 0:
        trainer.optimizer.shards[0].grad[0] = float("inf")
    result = trainer.optimizer.step()
    trainer.optimizer.finish_param_sync()
    assert result.skipped and trainer.optimizer.loss_scale == 512.0, f"rank {rank} did not skip"
    assert all(torch.equal(weights[n], p) for n, p in named_params(trainer)), "a skipped step changed weights"
    assert all(torch.equal(a, b) for a, b in zip(host, _host_state(trainer))), "a skipped step changed host state"
    assert not trainer.train_step(3).skipped


def check_accounting(rank: int, dtype_flags: list[str], device_per_element: int) -> None:
    trainer = build_trainer("llama", HALF + dtype_flags)
    trainer.train_step(1)
    optimizer = trainer.optimizer
    offloaded = [s for s in optimizer.shards if s.offloaded]
    on_device = [s for s in optimizer.shards if not s.offloaded]
    device, host = placement_bytes(optimizer.adam)
    assert host == sum(16 * s.main.numel() for s in offloaded)  # master, m, v and the gradient copy, fp32
    slab = optimizer.adam.host_memory.slab.untyped_storage()  # one allocation holds them all: its bytes count
    assert slab.nbytes() == host and {
        t.untyped_storage().data_ptr()
        for i, s in enumerate(optimizer.shards)
        if s.offloaded
        for t in (s.main, s.host_grad, optimizer.adam.exp_avg[i], optimizer.adam.exp_avg_sq[i])
    } <= {slab.data_ptr()}
    assert device == sum(device_per_element * s.main.numel() for s in on_device)
    padded = sum(chunk.buffer.layout.numel for chunk in trainer.chunks)
    assert sum(s.main.numel() for s in optimizer.shards) == padded // 2  # dp = 2
    assert all(s.main.device.type == "cpu" and s.host_grad is not None for s in offloaded)
    estimate = estimate_memory(trainer.run.model, layout_from_run(trainer.run, "cpu")).ranks[0]
    assert (estimate.optimizer_bytes, estimate.host_bytes) == (device, host)


def check_thread_budgets(rank: int) -> None:
    """The CPU step runs on its own thread budget; the training thread's (and that of threads
    started later, such as the batch loader's) stays what it was."""
    before = torch.get_num_threads()
    trainer = build_trainer("gpt", FULL + ["--cpu-optimizer-threads", str(before + 1)])
    offload = trainer.optimizer.adam.offload
    assert torch.get_num_threads() == before
    assert offload.pool.submit(torch.get_num_threads).result() == offload.threads == before + 1
    with ThreadPoolExecutor(1) as later:
        assert later.submit(torch.get_num_threads).result() == before


def check_gradient_copies_are_waited_for_where_reused(rank: int) -> None:
    """The training stream does not wait for the gradients' copies to host at the step: a model
    chunk's gradient buffer waits for its own copies when it is zeroed, just before that chunk's
    first backward of the next iteration. (CPU copies need no events: tokens stand in for them.)"""
    trainer = build_trainer("gpt", FULL + PP2 + VPP)
    shards, offload = trainer.optimizer.shards, trainer.optimizer.adam.offload
    transfers, waited, zeroed = offload.transfers, [], {}
    transfers.copy = lambda dst, src: (dst.copy_(src), ("copy", dst.data_ptr()))[1]
    transfers.synchronize = lambda event: None
    transfers.current_waits = waited.append
    for chunk in trainer.chunks:
        zero = chunk.zero_grad_buffer
        chunk.zero_grad_buffer = lambda zero=zero, chunk=chunk: (zero(), zeroed.setdefault(chunk, set(waited)))
    copies_of = {
        chunk: {("copy", shards[i].host_grad.data_ptr()) for i in offload.order if offload.buffer_of[i] is chunk.buffer}
        for chunk in trainer.chunks
    }
    trainer.train_step(1)
    assert not set().union(*copies_of.values()) & set(waited), "the step waited for gradient copies"
    zeroed.clear()
    trainer.train_step(2)
    order = list(zeroed)  # the chunks in the order their first backward zeroed them
    assert len(order) == len(trainer.chunks) == 2
    for position, chunk in enumerate(order):
        later = set().union(*(copies_of[c] for c in order[position + 1 :]))
        assert copies_of[chunk] and copies_of[chunk] <= zeroed[chunk], "zeroed before its copies were waited for"
        assert not later & zeroed[chunk], "waited for another chunk's copies before that chunk needed them"


def world2_checks(rank: int) -> None:
    check_fp16_inf_skips_everywhere(rank)
    check_thread_budgets(rank)
    check_gradient_copies_are_waited_for_where_reused(rank)
    check_accounting(rank, [], 8)  # fp32 weights are their own master on the device
    check_accounting(rank, ["--bf16"], 12)  # bf16: fp32 master + moments


def test_fp16_skip_and_byte_accounting():
    run_distributed(2, world2_checks)


@pytest.mark.parametrize(
    "flags,message",
    [
        (FULL + ["--optimizer-offload-fraction", "1.5"], "--optimizer-offload-fraction must be in [0, 1], got 1.5"),
        (["--optimizer-cpu-offload"], "--optimizer-cpu-offload needs --use-distributed-optimizer"),
        (DIST + ["--offload-policy", "auto"], "--offload-policy needs --optimizer-cpu-offload"),
        (
            FULL + ["--offload-policy", "auto", "--optimizer-offload-fraction", "0.5"],
            "applies to --offload-policy static",
        ),
        (FULL + ["--cpu-optimizer-threads", "0"], "--cpu-optimizer-threads must be >= 1"),
        (FULL + ["--offload-policy", "auto", "--grad-offload-fraction", "1"], "applies to --offload-policy static"),
        (FULL + ["--grad-offload-fraction", "1"], "--grad-offload-fraction needs sharded gradients"),
        (DIST + ["--param-offload-fraction", "0.5"], "--param-offload-fraction needs --optimizer-cpu-offload"),
        (
            [
                "--use-megatron-fsdp",
                "--data-parallel-sharding-strategy",
                "optim_grads",
                "--optimizer-cpu-offload",
                "--grad-offload-fraction",
                "1.5",
            ],
            "--grad-offload-fraction must be in [0, 1], got 1.5",
        ),
        (
            [
                "--use-megatron-fsdp",
                "--data-parallel-sharding-strategy",
                "optim_grads_params",
                "--optimizer-cpu-offload",
                "--grad-offload-fraction",
                "0.5",
                "--param-offload-fraction",
                "1",
            ],
            "need --param-offload-fraction (1) <= --grad-offload-fraction (0.5) <= --optimizer-offload-fraction (1)",
        ),
        (DIST + ["--unsharded-grad-accumulation"], "--unsharded-grad-accumulation applies to --data-parallel-sharding"),
    ],
)
def test_bad_input_is_one_line(flags, message):
    argv = [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "2",
        "--train-iters",
        "1",
        "--mock-data",
        "--vocab-size",
        "64",
    ] + flags
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_run_config(argv, LLAMA_DEFAULTS, 2)


def test_cli_budget_that_cannot_fit_is_one_line():
    out = run_cli("pretrain_llama.py", TINY_LLAMA + FULL + ["--device-memory-gb", "0.0001"])
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "even with all optimizer state on host" in out.stderr


def test_cli_torchrun_offload_matches_one_rank():
    four = torchrun_matching_one_rank("pretrain_llama.py", TINY_LLAMA, FULL, 4)
    line = re.search(r"offload: optimizer state on device (\S+) MiB \| host slab (\S+) MiB", four.stdout)
    assert line and float(line.group(1)) == 0.0 and float(line.group(2)) > 0, four.stdout[-3000:]
