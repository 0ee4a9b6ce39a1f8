#!/usr/bin/env python
"""Memory estimate vs. measurement, per rank, on CPU (gloo ranks), for tiny GPT and Llama runs.

    python tools/bench/estimator_accuracy.py [--model moe]     (--model: only that model's layouts)

Layouts: DP, TP, TP+SP, CP (ring attention), PP, interleaved and uneven PP, full and
selective recomputation, the distributed optimizer (several padded buckets, an embedding
tied across stages), the offload optimizer (full and half), sharded gradients (optim_grads)
and sharded parameters (optim_grads_params: DP, TP+SP x DP, CP x DP, PP x VPP x DP also
resharding after forward, and with half the optimizer offloaded), host-resident chunks (gradient
and parameter shards on host: all of them, and nested halves; host gradients under optim_grads),
the fused LM head + cross-entropy (TP+SP, and sharded parameters), fp32 and bf16; GPT with
dropout (SDPA math path on CPU), Llama without (SDPA's CPU flash path), and, when the
Triton interpreter is available, our Triton attention and norm kernels; a Llama with MoE layers
under EP2 (alltoall, allgather), EP2 x TP2+SP with ETP 1, EP2 x PP2, and EP2 over DP4 with the
distributed optimizer, half of it offloaded and optim_grads_params (experts over their edp ranks);
FP8 (delayed under TP2+SP in bf16, blockwise under DP2).

Measured on each rank after one training iteration (so Adam state exists):
- parameters / weights: the model chunks' parameters, whose storages are the flat parameter
  buffers (the experts' in a buffer of their own), plus each bucket's persistent shard where the parameters are sharded
  (optim_grads_params: the whole buckets are released after the step, so a bucket left
  gathered would count too); gradients: the flat `main_grad` buffers, or with optim_grads(_params)
  the fp32 gradient shards (plus any `param.grad` left); optimizer: the optimizer's
  state tensors (fp32 master copies that are not the weights, Adam moments) on the
  device; host: the host slab, which holds the offloaded shards' fp32 masters, moments and
  gradient copies (--optimizer-cpu-offload, full and f = 0.5) and the host-resident gradient and
  parameter shards (--grad-offload-fraction, --param-offload-fraction), none of which counts on
  the device;
- activations: unique storages that autograd saves for backward, seen by
  `torch.autograd.graph.saved_tensors_hooks` around each forward of the
  pipeline executor, parameters excluded (by their storages at the moment of saving: gathered
  parameters are re-allocated per use), plus the p2p-received input the
  executor holds until that backward; summed over the (microbatch, chunk)
  forwards alive at each point of the schedule, and the peak taken.
The estimate is `estimate_memory` for the same RunConfig on device type "cpu".
Host aside (not device memory), these are the certain part of the estimate; tests/parallel/test_memory_measured.py
requires every component (and the microbatch-chunks in flight) to equal the
measurement byte for byte. Transients and allowances are not measured (CPU has no
allocator statistics); nor are the whole buckets that sharded strategies gather or fill
during forward/backward (the estimate's `gathered_bytes`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: its kernels run on CPU tensors
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kernels.triton_support import INTERPRETER  # noqa: E402
from megatron.planning.estimator import estimate_memory  # noqa: E402
from megatron.training.arguments.parser import GPT_DEFAULTS, LLAMA_DEFAULTS, parse_run_config  # noqa: E402
from megatron.training.memory_check import layout_from_run  # noqa: E402
from megatron.training.trainer import Trainer  # noqa: E402

BASE = [
    "--num-layers",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "1",
    "--mock-data",
    "--vocab-size",
    "100",
]
LLAMA = ["--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4"]
LLAMA += ["--ffn-hidden-size", "96"]
# MoE layers 0 and 2 of the Llama: 4 experts of intermediate 32, top-2, aux and z losses
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "2", "--moe-aux-loss-coeff", "0.01"]
MOE += ["--moe-z-loss-coeff", "0.001"]
# capacity-limited and padded, so that every expert runs exactly its capacity of rows: with dropless routing the
# activations are data (the estimate assumes the balanced load there: megatron/planning/moe_routing.py)
PADDED = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"]
MODELS = {  # GPT keeps its dropout (CPU attention takes the math path); Llama has none (CPU flash path)
    "gpt": (GPT_DEFAULTS, ["--hidden-size", "32", "--num-attention-heads", "4"]),
    "llama": (LLAMA_DEFAULTS, LLAMA),
    "moe": (LLAMA_DEFAULTS, LLAMA + MOE + PADDED),
    "moe-dropless": (LLAMA_DEFAULTS, LLAMA + MOE),
    # head dim 64, which our Triton flash-attention kernel takes; 2 layers, 2 microbatches (interpreter speed)
    "llama-d64": (
        LLAMA_DEFAULTS,
        [
            "--hidden-size",
            "128",
            "--num-attention-heads",
            "2",
            "--ffn-hidden-size",
            "192",
            "--num-layers",
            "2",
            "--global-batch-size",
            "4",
        ],
    ),
}
TP2, SP, PP2, VPP2 = (
    ["--tensor-model-parallel-size", "2"],
    ["--sequence-parallel"],
    ["--pipeline-model-parallel-size", "2"],
    ["--num-layers-per-virtual-pipeline-stage", "1"],
)
FULL_UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
FULL_BLOCK = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]
SELECTIVE = ["--recompute-granularity", "selective"]
BF16 = ["--bf16"]
CP2, DISTOPT = ["--context-parallel-size", "2"], ["--use-distributed-optimizer"]
BUCKETS = ["--ddp-bucket-size", "3000"]  # several buckets per chunk, each padded to dp x cp x 64 elements
ZBV = ["--pipeline-schedule", "zbv"]  # two chunks per rank in V placement, the turn on the last rank local
UNEVEN = ["--decoder-first-pipeline-num-layers", "1"]  # pp2: 1 layer on the first rank, 3 on the last
NO_ATTN_DROPOUT = ["--attention-dropout", "0"]  # the ring attention has no dropout
TRITON = ["--kernel-impl", "triton"]  # attention, norms, RoPE and SwiGLU
OFFLOAD = DISTOPT + ["--optimizer-cpu-offload"]  # the static policy; f = 0.5 below takes whole chunks
HALF = ["--optimizer-offload-fraction", "0.5"]
EP2, ALLTOALL = ["--expert-model-parallel-size", "2"], ["--moe-token-dispatcher-type", "alltoall"]
ETP1 = ["--expert-tensor-parallel-size", "1"]
HOST_FULL = ["--grad-offload-fraction", "1", "--param-offload-fraction", "1"]  # host-resident chunks
HOST_HALF = ["--grad-offload-fraction", "0.5", "--param-offload-fraction", "0.5"]
# sharded gradients (and parameters): the shards are what stays; the whole buckets gathered or filled
# during forward/backward (the estimate's gathered_bytes) are transients, not measured here
OPTIM_GRADS = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]
OPTIM_GRADS_PARAMS = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
CE_FUSION = ["--cross-entropy-loss-fusion"]  # the output layer and the loss in token chunks: no logits kept
# world size -> [(name, model, flags)]; the Triton kernels (the GPU path) run only under the interpreter here
LAYOUTS = {
    **(
        {
            1: [
                ("triton-kernels-bf16", "llama-d64", TRITON + BF16),
                ("triton-kernels-full-uniform", "llama-d64", TRITON + FULL_UNIFORM),
            ]
        }
        if INTERPRETER
        else {}
    ),
    2: [
        ("dp2", "gpt", []),
        ("dp2-bf16", "llama", BF16),
        ("tp2", "gpt", TP2),
        ("tp2-sp", "llama", TP2 + SP),
        ("tp2-sp-selective", "gpt", TP2 + SP + SELECTIVE),
        ("pp2-vpp2", "llama", PP2 + VPP2),
        ("pp2-vpp2-full-uniform", "gpt", PP2 + VPP2 + FULL_UNIFORM),
        ("pp2-full-block-bf16", "llama", PP2 + FULL_BLOCK + BF16),
        ("pp2-uneven-1-3", "llama", PP2 + UNEVEN),
        ("pp2-zbv", "gpt", PP2 + ZBV),  # V placement: both ends of the tied embedding on rank 0
        ("dp2-distopt", "gpt", DISTOPT),
        ("dp2-distopt-bf16-buckets", "llama", DISTOPT + BF16 + BUCKETS),
        ("cp2", "llama", CP2),
        ("dp2-offload-bf16", "llama", OFFLOAD + BF16),
        ("dp2-offload-half-buckets", "gpt", OFFLOAD + HALF + BUCKETS),
        ("dp2-offload-half-bf16-buckets", "llama", OFFLOAD + HALF + BF16 + BUCKETS),
        ("dp2-optim-grads-bf16-buckets", "llama", OPTIM_GRADS + BF16 + BUCKETS),
        ("dp2-optim-grads-params-buckets", "gpt", OPTIM_GRADS_PARAMS + BUCKETS),
        (
            "dp2-optim-grads-params-offload-half-bf16-buckets",
            "llama",
            OPTIM_GRADS_PARAMS + OFFLOAD + HALF + BF16 + BUCKETS,
        ),
        (
            "dp2-optim-grads-params-host-full-bf16-buckets",
            "llama",
            OPTIM_GRADS_PARAMS + OFFLOAD + HOST_FULL + BF16 + BUCKETS,
        ),
        (
            "dp2-optim-grads-host-grads-half-buckets",
            "gpt",
            OPTIM_GRADS + OFFLOAD + ["--grad-offload-fraction", "0.5"] + BUCKETS,
        ),
        ("ep2-alltoall", "moe", EP2 + ALLTOALL),
        ("ep2-allgather-bf16", "moe", EP2 + BF16),
        ("tp2-sp-ce-fusion", "llama", TP2 + SP + CE_FUSION),
        ("dp2-optim-grads-params-ce-fusion-bf16", "gpt", OPTIM_GRADS_PARAMS + CE_FUSION + BF16),
        ("tp2-sp-fp8-delayed-bf16", "llama", TP2 + SP + BF16 + ["--fp8-format", "hybrid"]),
        ("dp2-fp8-blockwise", "gpt", ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]),
    ],
    4: [
        ("tp2-sp-pp2-vpp2", "gpt", TP2 + SP + PP2 + VPP2),
        ("tp2-sp-pp2-bf16", "llama", TP2 + SP + PP2 + BF16),
        ("pp4", "llama", ["--pipeline-model-parallel-size", "4"]),
        ("dp2-pp2-bf16", "gpt", PP2 + BF16),
        ("dp2-pp2-distopt-bf16", "gpt", PP2 + DISTOPT + BF16),
        ("dp2-pp2-zbv-distopt-bf16", "gpt", PP2 + ZBV + DISTOPT + BF16),
        ("cp2-dp2-distopt-bf16", "llama", CP2 + DISTOPT + BF16),
        ("cp2-tp2-sp", "llama", CP2 + TP2 + SP),
        ("cp2-tp2-sp", "gpt", CP2 + TP2 + SP + NO_ATTN_DROPOUT),
        ("dp2-pp2-vpp2-offload-half-bf16-buckets", "gpt", PP2 + VPP2 + OFFLOAD + HALF + BF16 + BUCKETS),
        ("cp2-dp2-pp2-optim-grads", "gpt", CP2 + PP2 + OPTIM_GRADS + NO_ATTN_DROPOUT),
        ("tp2-sp-dp2-optim-grads-params-bf16", "llama", TP2 + SP + OPTIM_GRADS_PARAMS + BF16),
        ("cp2-dp2-optim-grads-params-bf16-buckets", "llama", CP2 + OPTIM_GRADS_PARAMS + BF16 + BUCKETS),
        ("dp2-pp2-vpp2-optim-grads-params", "gpt", PP2 + VPP2 + OPTIM_GRADS_PARAMS),
        (
            "dp2-pp2-vpp2-optim-grads-params-reshard-bf16",
            "llama",
            PP2 + VPP2 + OPTIM_GRADS_PARAMS + ["--reshard-params-after-forward"] + BF16,
        ),
        (
            "tp2-sp-dp2-optim-grads-params-host-half-bf16",
            "llama",
            TP2 + SP + OPTIM_GRADS_PARAMS + OFFLOAD + HOST_HALF + BF16 + BUCKETS,
        ),
        ("ep2-tp2-sp-etp1-alltoall", "moe", EP2 + TP2 + SP + ETP1 + ALLTOALL),
        ("dp4-ep2-distopt-alltoall-buckets", "moe", EP2 + DISTOPT + ALLTOALL + BUCKETS),
        ("ep2-pp2-alltoall", "moe", EP2 + PP2 + ALLTOALL),
        ("dp4-ep2-offload-half-bf16-buckets", "moe", EP2 + ALLTOALL + OFFLOAD + HALF + BF16 + BUCKETS),
        ("dp4-ep2-optim-grads-params-bf16-buckets", "moe", EP2 + ALLTOALL + OPTIM_GRADS_PARAMS + BF16 + BUCKETS),
    ],
}
# dropless routing: the rows each expert runs are data, so these are not compared exactly but printed against
# the estimate at the balanced load and its "MoE routing imbalance" allowance
DROPLESS = {2: [("ep2-alltoall", "moe-dropless", EP2 + ALLTOALL), ("ep2-allgather", "moe-dropless", EP2)]}
COMPONENTS = ("parameters", "weights_bytes", "grads_bytes", "optimizer_bytes", "host_bytes", "activations_bytes")


def _storage(t: torch.Tensor):
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _unique_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors`; freed storages hold none."""
    return sum(dict(ptr_bytes for ptr_bytes in map(_storage, tensors) if ptr_bytes[1]).values())


class SavedTensorMeter:
    """Wraps a PipelineExecutor's forward / backward to track the saved activations alive.

    A saved tensor is a weight, not an activation, when it shares a storage with a parameter
    *at the moment it is saved*: under optim_grads_params a bucket's parameters are views of a
    storage that is freed and allocated again around each use (`TransientBuffer`), so its
    address moves, and an address once a weight's may later hold an activation."""

    def __init__(self, executor, params):
        self.params = params
        self.live: dict = {}
        self.peak_bytes = self.peak_microbatches = 0
        forward, backward = executor._forward, executor._backward

        def metered_forward(action, inputs, batch, stats, scale):
            key = (action.microbatch, action.chunk)
            storages = self.live.setdefault(key, {})

            def pack(t):
                ptr, nbytes = _storage(t)
                if ptr not in self._weight_ptrs():
                    storages[ptr] = nbytes
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = forward(action, inputs, batch, stats, scale)
            if key in inputs:  # the p2p-received input, held by the executor until this backward
                storages.setdefault(*_storage(inputs[key]))
            self._mark()
            return out

        def metered_backward(action, *args):
            backward(action, *args)
            self.live.pop((action.microbatch, action.chunk))

        executor._forward, executor._backward = metered_forward, metered_backward

    def _weight_ptrs(self) -> set:
        """Addresses of the parameters' storages now (freed ones have none)."""
        return {ptr for ptr, nbytes in map(_storage, self.params) if nbytes}

    def _mark(self) -> None:
        union = {ptr: n for storages in self.live.values() for ptr, n in storages.items()}
        self.peak_bytes = max(self.peak_bytes, sum(union.values()))
        self.peak_microbatches = max(self.peak_microbatches, len(self.live))


def measure(trainer: Trainer) -> dict:
    """Host memory is the host slab (offloaded optimizer state, host-resident gradient and
    parameter shards are all cut from it: on CPU the same memory, allocated apart); every other
    storage counts as the device's."""
    params = [p for chunk in trainer.chunks for p in chunk.module.parameters()]
    meter = SavedTensorMeter(trainer.executor, params)
    trainer.train_step(1)
    memory = trainer.optimizer.adam.host_memory
    slab = _storage(memory.slab)[0] if memory is not None else None

    def on_device(tensors):
        return [t for t in tensors if _storage(t)[0] != slab]

    buffers = [buffer for c in trainer.chunks for buffer in c.buffers]  # the experts' buffers too
    buckets = [b for buffer in buffers for b in buffer.buckets]
    grads = [
        t
        for buffer in buffers
        for t in ([buffer.grad_data] if buffer.grad_data is not None else [b.grad_shard for b in buffer.buckets])
    ]
    grads += [p.grad for p in params if p.grad is not None]
    # the weights' storages, and the persistent shards where a bucket's whole parameters are
    # transient (optim_grads_params: released after the step, so they count only if still there)
    weights = params + [b.param_shard for b in buckets]
    return {
        "parameters": sum(p.numel() for p in params),
        "weights_bytes": _unique_bytes(on_device(weights)),
        "grads_bytes": _unique_bytes(on_device(grads)),
        "optimizer_bytes": _unique_bytes(on_device(trainer.optimizer.adam.state_tensors())),
        "host_bytes": memory.nbytes if memory is not None else 0,
        "activations_bytes": meter.peak_bytes,
        "peak_microbatches": meter.peak_microbatches,
    }


def run_config(model: str, flags: list[str], world_size: int):
    defaults, model_flags = MODELS[model]
    return parse_run_config(BASE + model_flags + flags, defaults, world_size)


def estimate(model: str, flags: list[str], world_size: int, pp_rank: int) -> dict:
    run = run_config(model, flags, world_size)
    rank = estimate_memory(run.model, layout_from_run(run, "cpu")).ranks[pp_rank]
    return {name: getattr(rank, name) for name in COMPONENTS + ("peak_microbatches",)}


def measure_layouts(rank: int, layouts: list) -> list[dict]:
    """On every rank of a gloo world: measure each layout, return (pp rank, measured) per layout."""
    out = []
    for _, model, flags in layouts:
        trainer = Trainer(run_config(model, flags, dist.get_world_size()), torch.device("cpu"))
        out.append({"pp_rank": trainer.mesh.pp_rank, "measured": measure(trainer)})
    return out


def compare(world_size: int, layouts: list, per_rank: list) -> list[dict]:
    """One row per (layout, rank): measured, estimated and relative error of each component."""
    rows = []
    for index, (name, model, flags) in enumerate(layouts):
        for rank, results in enumerate(per_rank):
            got = results[index]
            expected = estimate(model, flags, world_size, got["pp_rank"])
            rows.append(
                {
                    "layout": f"{model} {name}",
                    "rank": rank,
                    "pp_rank": got["pp_rank"],
                    "measured": got["measured"],
                    "estimate": expected,
                }
            )
    return rows


def _cells(m: dict, e: dict) -> list[str]:
    return [f"{m[c]:,} / {e[c]:,}" for c in COMPONENTS + ("peak_microbatches",)]


def main(argv: list[str]) -> int:
    from tests.distributed import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), help="only the layouts of this model")
    only = parser.parse_args(argv).model
    exact = {world: [lay for lay in layouts if only in (None, lay[1])] for world, layouts in LAYOUTS.items()}
    if any(exact.values()):
        print("\n".join(exact_table(run_distributed, exact)))
    if only in (None, "moe-dropless"):
        print("\n".join(dropless_table(run_distributed)))
    return 0


def exact_table(run_distributed, layouts_by_world: dict) -> list[str]:
    """Every component measured / estimated, per rank (ranks of a pipeline stage that agree share a row)."""
    lines = [
        "Measured / estimated bytes per rank (ranks of one pipeline stage that agree share a row).\n",
        "| layout | world | ranks (pp rank) | parameters | weights | grads | optimizer | host | activations "
        "| microbatch-chunks in flight |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    differing = 0
    for world, layouts in layouts_by_world.items():
        if not layouts:
            continue
        grouped: dict = {}
        for row in compare(world, layouts, run_distributed(world, measure_layouts, layouts)):
            m, e = row["measured"], row["estimate"]
            differing += sum(m[c] != e[c] for c in COMPONENTS + ("peak_microbatches",))
            key = (row["layout"], row["pp_rank"], tuple(_cells(m, e)))
            grouped.setdefault(key, []).append(str(row["rank"]))
        for (layout, pp_rank, cells), ranks in grouped.items():
            lines.append(f"| {layout} | {world} | {','.join(ranks)} ({pp_rank}) | " + " | ".join(cells) + " |")
    return lines + [f"\n(rank, component) pairs where estimate and measurement differ: {differing}"]


def dropless_table(run_distributed) -> list[str]:
    """Saved activations measured under dropless routing against the estimate at the balanced load."""
    lines = [
        "\nDropless routing (the rows per expert are data): saved activations, measured / estimated at the "
        "balanced load\n",
        "| layout | world | rank | measured | estimated | measured / estimated | imbalance allowance |",
        "|---|---|---|---|---|---|---|",
    ]
    for world, layouts in DROPLESS.items():
        per_rank = run_distributed(world, measure_layouts, layouts)
        for index, (name, model, flags) in enumerate(layouts):
            run = run_config(model, flags, world)
            for rank, results in enumerate(per_rank):
                got = results[index]
                estimated = estimate_memory(run.model, layout_from_run(run, "cpu")).ranks[got["pp_rank"]]
                m, e = got["measured"]["activations_bytes"], estimated.activations_bytes
                lines.append(
                    f"| {model} {name} | {world} | {rank} | {m:,} | {e:,} | {m / e:.3f} | "
                    f"{estimated.transients.moe_imbalance_bytes:,} |"
                )
    return lines


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
