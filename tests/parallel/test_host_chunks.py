"""Host-resident chunks (PatrickStar's placement, on our buckets) reproduce the one-process run.

optim_grads_params with the offload optimizer, whose chunks also keep their fp32 gradient shard
(--grad-offload-fraction) and their parameter shard (--param-offload-fraction) in host memory:
every part of every chunk on host (static 1/1/1), nested halves (static 1/0.5/0.5), and
--offload-policy auto under a device budget that keeps some parts of some chunks. At one rank
(Llama, every part on host), DP2 (GPT with tied embeddings, Llama), TP2 x SP x DP2 (Llama) and
PP2 (v2) x DP2 (GPT), clipping active, 4 microbatches per dp rank (8 at one rank), buckets small
enough that parameters straddle shards: the losses of 5
iterations, the iteration-1 grad norm and the parameters after 5 steps match one process (1e-5).

Per rank, after the first step: the device bytes of weights, gradients and optimizer state and
the host slab equal the memory estimator's for the static layouts, and while the trainer is
built and runs its first two steps (the first forward has no trace to release by) the buckets
hold on the device, besides the shards they keep there, at most the estimate's gathered buckets
(host-resident shards are made on host; a forward holds the buckets in use); under auto the
placement is partial and the parts it kept on the device are the bytes it decided. In one step the parameter
shards fetched from host are 2 per microbatch for each host-resident parameter chunk without
pipelining (forward and backward gathers) and 1 per step under PP (kept gathered from forward to
backward), the gradient copies to host one reduce-scattered shard per microbatch for each
host-resident gradient chunk, and some gathers were started ahead. A run saved with every shard
on host resumes bit for bit so, and continues without offload at TP2 as the uninterrupted run
does. Where the auto placement leaves device room over, each forward keeps gathered buckets for
its backward within it (fewer all-gathers than two per bucket per microbatch) and the run still
matches one process. torchrun with 2 ranks prints the one-rank losses and the host traffic; a
host budget below the slab is one line.
"""

from __future__ import annotations

import functools
import re

import pytest

from megatron.core.distributed.param_and_grad_buffer import Bucket
from megatron.core.distributed.transient import TransientBuffer
from megatron.core.optimizer.offload import placement_bytes
from megatron.planning.estimator import estimate_memory
from megatron.training.memory_check import layout_from_run
from tests.cli import TINY_LLAMA, explain, run_cli, torchrun_matching_one_rank
from tests.distributed import run_distributed
from tests.parallel.layouts import assert_final_weights_match, build_trainer, train
from tests.parallel.test_distributed_optimizer import COMMON, LR, PP2, SP, TP2, VPP
from tests.parallel.test_sharding_strategies import save_and_resume
from tools.bench.distributed_optimizer import count_collectives

HOST = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--optimizer-cpu-offload"]
FULL = HOST + ["--grad-offload-fraction", "1", "--param-offload-fraction", "1"]
HALF = HOST + ["--grad-offload-fraction", "0.5", "--param-offload-fraction", "0.5"]
AUTO = HOST + ["--offload-policy", "auto", "--device-memory-gb"]  # a budget that keeps some parts, not all:
LAYOUTS = {  # world -> name -> (model, flags)
    1: {"dp1-full-llama": ("llama", FULL)},
    2: {
        "dp2-full-gpt": ("gpt", FULL),
        "dp2-half-llama": ("llama", HALF),
        "dp2-auto-gpt": ("gpt", AUTO + ["0.0007"]),
        "dp2-auto-spare-gpt": ("gpt", AUTO + ["0.00075"]),
    },  # room left over: buckets kept for backward
    4: {
        "tp2-sp-dp2-full-llama": ("llama", FULL + TP2 + SP),
        "pp2-vpp2-dp2-half-gpt": ("gpt", HALF + PP2 + VPP),
        "pp2-vpp2-dp2-auto-gpt": ("gpt", AUTO + ["0.00062"] + PP2 + VPP),
    },
}
CASES = [(world, name) for world, layouts in LAYOUTS.items() for name in layouts]


def _bucket_device_bytes(bucket: Bucket) -> int:
    """What `bucket` holds on the device now: whole buckets (gathered parameters, unsharded
    gradient), its reduce-scatter output, and its shards not in host memory."""
    tensors = [getattr(bucket, "_scattered", None)]
    tensors += [bucket.param_full.data] if bucket.shards_params else []
    tensors += [bucket.grad_full.data] if bucket.shards_grads else []
    tensors += [] if bucket.params_on_host else [bucket.param_shard]
    tensors += [] if bucket.grads_on_host else [bucket.grad_shard]
    return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)


class BucketBytes:
    """The most bytes that the buckets made inside hold on the device at once, per `phase`:
    sampled after every allocation of their memory (a bucket made, a whole bucket allocated,
    a reduce-scatter started)."""

    PATCHED = ((Bucket, "__init__"), (Bucket, "start_grad_reduce"), (TransientBuffer, "allocate"))

    def __init__(self):
        self.buckets, self.peaks, self.phase = {}, {}, "build"

    def __enter__(self):
        self._originals = [getattr(owner, name) for owner, name in self.PATCHED]
        for (owner, name), original in zip(self.PATCHED, self._originals):
            setattr(owner, name, self._sampled(original))
        return self

    def __exit__(self, *exc):
        for (owner, name), original in zip(self.PATCHED, self._originals):
            setattr(owner, name, original)

    def _sampled(self, original):
        @functools.wraps(original)
        def sampled(obj, *args, **kwargs):
            out = original(obj, *args, **kwargs)
            if isinstance(obj, Bucket):
                self.buckets[obj] = None
            held = sum(_bucket_device_bytes(bucket) for bucket in self.buckets)
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), held)
            return out

        return sampled


def _accounting(model: str, flags: list[str]) -> dict:
    """Bytes where they live after step 1, the traffic of step 2, and the buckets' device bytes
    at their peak while building and during steps 1 and 2."""
    with BucketBytes() as buckets_held:
        trainer = build_trainer(model, COMMON + flags)
        optimizer, host = trainer.optimizer, trainer.optimizer.host
        buckets_held.phase = "steps"
        trainer.train_step(1)
        host.take_stats()
        with count_collectives() as collectives:
            trainer.train_step(2)
    traffic = host.take_stats()
    params, grads = (sum(v) for v in zip(*(chunk.buffer.kept_bytes() for chunk in trainer.chunks)))
    device_optimizer, slab = placement_bytes(optimizer.adam)
    run = trainer.run
    rank = estimate_memory(run.model, layout_from_run(run, "cpu")).ranks[trainer.mesh.pp_rank]
    buckets = [bucket for chunk in trainer.chunks for bucket in chunk.buffer.buckets]
    decision = trainer.placement_decision
    return {
        "bytes": (params, grads, device_optimizer, slab),
        "estimate": (rank.weights_bytes, rank.grads_bytes, rank.optimizer_bytes, rank.host_bytes),
        "slab_holds": {b.param_shard.untyped_storage().data_ptr() for b in buckets if b.params_on_host}
        | {b.grad_shard.untyped_storage().data_ptr() for b in buckets if b.grads_on_host}
        <= {optimizer.adam.host_memory.slab.untyped_storage().data_ptr()},
        "traffic": (traffic.fetches, traffic.prefetched, traffic.h2d_bytes, traffic.d2h_bytes),
        "host_param_bytes": sum(
            b.param_shard.numel() * b.param_shard.element_size() for b in buckets if b.params_on_host
        ),
        "host_params": sum(b.params_on_host for b in buckets),
        "host_grad_bytes": sum(4 * b.grad_shard.numel() for b in buckets if b.grads_on_host),
        "counts": host.placement.counts(),
        "chunks": len(buckets),
        "m": run.training.num_microbatches,
        "kept": None if decision is None else decision.kept_bytes,
        "spare": None if decision is None else decision.spare_bytes,
        "gathered": collectives["all_gather_single"],
        "bucket_bytes": sum(b.param_full.nbytes for b in buckets),
        "bucket_peaks": buckets_held.peaks,
        "gathered_estimate": rank.gathered_bytes,
    }


def world_runs(rank: int, world: int) -> list[dict]:
    out = []
    for model, flags in LAYOUTS[world].values():
        result = train(model, COMMON + flags)
        result["accounting"] = _accounting(model, flags)
        out.append(result)
    return out


@pytest.fixture(scope="module")
def results():
    references = run_distributed(1, lambda rank: [train(model, COMMON) for model in ("gpt", "llama")])[0]
    out = {("reference", "gpt"): references[0], ("reference", "llama"): references[1]}
    for world, layouts in LAYOUTS.items():
        per_rank = run_distributed(world, world_runs, world)
        for index, name in enumerate(layouts):
            out[name] = [rank_out[index] for rank_out in per_rank]
    return out


@pytest.mark.parametrize("world,layout", CASES, ids=[name for _, name in CASES])
def test_host_chunks_match_one_process(results, world, layout):
    model, _ = LAYOUTS[world][layout]
    reference = results[("reference", model)]
    assert reference["grad_norms"][0] > 0.3, "clipping must be active"
    for rank, out in enumerate(results[layout]):
        assert_final_weights_match(rank, out, reference, LR)
        acc = out["accounting"]
        counts, chunks = acc["counts"], acc["chunks"]
        assert acc["slab_holds"], f"rank {rank}: a host-resident shard outside the host slab"
        if "full" in layout:
            assert counts == {"optimizer": chunks, "grads": chunks, "params": chunks}
            assert acc["bytes"][:3] == (0, 0, 0), f"rank {rank}: device bytes {acc['bytes']}"
        elif "half" in layout:
            assert counts["optimizer"] == chunks and 0 < counts["params"] <= counts["grads"] < chunks, counts
        else:
            assert 0 < counts["params"] + counts["grads"] + counts["optimizer"] < 3 * chunks, counts
            assert sum(acc["bytes"][:3]) == acc["kept"], f"rank {rank}: device bytes {acc['bytes']} vs decided"
        if "auto" not in layout:  # auto is estimated as full residency (its best case), and keeps more gathered
            assert acc["bytes"] == acc["estimate"], f"rank {rank}: measured {acc['bytes']} vs {acc['estimate']}"
            kept_shards = acc["bytes"][0] + acc["bytes"][1]
            for phase, peak in acc["bucket_peaks"].items():
                assert peak - kept_shards <= acc["gathered_estimate"], (
                    f"rank {rank} {phase}: buckets held {peak - kept_shards} bytes beyond their kept shards, "
                    f"the estimate's gathered buckets {acc['gathered_estimate']}"
                )
        fetches, prefetched, h2d, d2h = acc["traffic"]
        gathers = 1 if "pp2" in layout else 2 * acc["m"]
        assert h2d == gathers * acc["host_param_bytes"], f"rank {rank}: {h2d} bytes fetched"
        assert fetches == gathers * acc["host_params"] and (prefetched > 0 or not fetches), acc["traffic"]
        assert d2h == acc["m"] * acc["host_grad_bytes"], f"rank {rank}: {d2h} bytes of gradients to host"
        every = gathers * acc["bucket_bytes"]  # each bucket gathered before each use
        if "tp2" in layout:  # sequence parallelism's all-gathers are counted with them
            continue
        if "spare" in layout:  # buckets kept from forward to backward within the spare room
            assert acc["spare"] > 0 and acc["gathered"] < every, (acc["spare"], acc["gathered"], every)
        else:
            assert acc["gathered"] == every, f"rank {rank}: {acc['gathered']} bytes gathered, expected {every}"


def test_cli_torchrun_host_resident_matches_one_rank():
    """From the command line: 2 ranks with every shard on host print the one-rank losses and the
    host traffic; a host budget below the slab is refused at start-up in one line, and so is an
    auto placement that cannot fit both budgets."""
    two = torchrun_matching_one_rank("pretrain_llama.py", TINY_LLAMA, FULL, 2)
    line = re.search(
        r"host slab \S+ MiB \(optimizer state of (\d+), gradients of (\d+), parameters of (\d+) of "
        r"(\d+) chunks\).*parameter gathers from host (\S+)/iter, started ahead (\d+)%",
        two.stdout,
    )
    assert line and len(set(line.groups()[:4])) == 1 and float(line.group(5)) > 0, two.stdout[-3000:]
    tight = run_cli("pretrain_llama.py", TINY_LLAMA + FULL + ["--host-memory-gb", "0.00001"])
    assert tight.returncode == 2 and tight.stderr.strip().count("\n") == 0, explain(tight)
    assert "of host-resident chunk state" in tight.stderr and "--host-memory-gb" in tight.stderr
    auto = run_cli(
        "pretrain_llama.py",
        TINY_LLAMA + HOST + ["--offload-policy", "auto", "--device-memory-gb", "0.0012", "--host-memory-gb", "0.00001"],
    )
    assert auto.returncode == 2 and auto.stderr.strip().count("\n") == 0, explain(auto)
    assert "--offload-policy auto finds no placement" in auto.stderr and "DOES NOT FIT" in auto.stderr


def test_checkpoint_resumes_with_and_without_host_chunks(tmp_path):
    resumed = {
        "same": FULL,
        "tp2-plain": TP2 + ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"],
    }
    for rank, out in enumerate(run_distributed(2, save_and_resume, str(tmp_path), FULL, resumed)):
        assert out["same"] == out["straight"], f"rank {rank}: not bit for bit"
        for (loss, norm), (expected, expected_norm) in zip(out["tp2-plain"], out["straight"]):
            assert abs(loss - expected) <= 1e-5 * expected and abs(norm - expected_norm) <= 1e-5 * expected_norm
