"""Published training throughputs the step-time model is calibrated and checked against.

Each row is a run that really happened, in pretrain_gpt.py flags, with the TFLOP/s per GPU
its authors published. Two sources:

* Megatron-LM SC21 (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", 2021), Table 1; the launch script is NVIDIA/Megatron-LM
  examples/sc21/run_table_1.sh and the same table is in its 2021 README. A100 80 GB (Selene:
  DGX A100, 8 x HDR InfiniBand per node), fp16, seq 2048, vocab 51,200, full recomputation
  (uniform, one layer per checkpoint), the replicated optimizer, no sequence parallelism
  (it came in 2022) and Megatron's unfused attention of the time (scaled-masked softmax, dropout
  0.1, batched GEMMs: our "math" kernel); gradients all-reduced after the backward. Reported:
  hardware TFLOP/s per GPU (recomputation counted).
* Megatron-Core r0.8 weak scaling, NVIDIA/Megatron-LM README's table (images/model_table.png):
  H100 80 GB (DGX H100, 8 x NDR InfiniBand per node), bf16, seq 4096, vocab 131,072, dp 48,
  the distributed optimizer with overlapped gradient reduce-scatter and parameter all-gather,
  sequence parallelism, bf16 gradient buffers (Megatron-Core's default without
  --accumulate-allreduce-grads-in-fp32; ours are always fp32), flash attention (no dropout),
  GPT layers (GELU MLP of 4 h, untied embeddings: the parameter counts match the table's
  names). Reported: model TFLOP/s per GPU.
  Micro batch and virtual stages are not published: the planner picks them (its fastest
  layout that fits among micro batch 1, 2, 4 and every valid virtual-stage count).

`MEMORY_RUNS`: layouts that trained without running out of memory, for the fit rule's check
(tools/bench/fit_rule_outcomes.py), with no throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SC21 = "Megatron-LM SC21 Table 1 (examples/sc21/run_table_1.sh)"
MCORE = "Megatron-Core r0.8 weak scaling (Megatron-LM README, images/model_table.png)"


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    device: str  # a preset of megatron/planning/hardware.py
    num_gpus: int
    flags: tuple[str, ...]  # pretrain_gpt.py flags of the run
    attention: str  # the attention kernel it ran (megatron/planning/kernels.py names)
    metric: str  # "hardware" (recomputation counted) or "model" TFLOP/s per GPU
    tflops: float
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    searched: bool = False  # micro batch and virtual stages not published: the planner picks them
    grad_dtype: torch.dtype = torch.float32  # gradient buffer element: Megatron-Core's default holds bf16 gradients


def _sc21(name, layers, hidden, heads, tp, pp, gpus, gbs, mbs, tflops, layers_per_virtual=None):
    flags = [
        "--num-layers",
        layers,
        "--hidden-size",
        hidden,
        "--num-attention-heads",
        heads,
        "--seq-length",
        2048,
        "--max-position-embeddings",
        2048,
        "--vocab-size",
        51200,
        "--fp16",
        "--tensor-model-parallel-size",
        tp,
        "--pipeline-model-parallel-size",
        pp,
        "--micro-batch-size",
        mbs,
        "--global-batch-size",
        gbs,
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        1,
    ]
    if layers_per_virtual:
        flags += ["--num-layers-per-virtual-pipeline-stage", layers_per_virtual]
    return PublishedRun(
        f"SC21 {name}",
        SC21,
        "a100-80gb",
        gpus,
        tuple(map(str, flags)),
        "math",
        "hardware",
        tflops,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
    )


def _mcore(name, layers, hidden, heads, tp, pp, gbs, tflops):
    gpus = tp * pp * 48
    flags = [
        "--num-layers",
        layers,
        "--hidden-size",
        hidden,
        "--num-attention-heads",
        heads,
        "--seq-length",
        4096,
        "--max-position-embeddings",
        4096,
        "--vocab-size",
        131072,
        "--bf16",
        "--untie-embeddings-and-output-weights",
        "--attention-dropout",
        0,
        "--hidden-dropout",
        0,
        "--tensor-model-parallel-size",
        tp,
        "--pipeline-model-parallel-size",
        pp,
        "--global-batch-size",
        gbs,
        "--use-distributed-optimizer",
    ]
    if tp > 1:
        flags.append("--sequence-parallel")
    return PublishedRun(
        f"MCore {name}",
        MCORE,
        "h100-80gb",
        gpus,
        tuple(map(str, flags)),
        "flash",
        "model",
        tflops,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        searched=True,
        grad_dtype=torch.bfloat16,
    )


RUNS = (
    _sc21("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 137),
    _sc21("3.6B", 30, 3072, 32, 2, 1, 64, 512, 16, 138),
    _sc21("7.5B", 36, 4096, 32, 4, 1, 128, 512, 16, 142),
    _sc21("18.4B", 40, 6144, 48, 8, 1, 256, 1024, 8, 135),
    _sc21("39.1B", 48, 8192, 64, 8, 2, 512, 1536, 4, 138),
    _sc21("76.1B", 60, 10240, 80, 8, 4, 1024, 1792, 2, 140, layers_per_virtual=5),
    _sc21("145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 2, 148, layers_per_virtual=5),
    _sc21("310.1B", 96, 16384, 128, 8, 16, 1920, 2160, 1, 155, layers_per_virtual=3),
    _sc21("529.6B", 105, 20480, 128, 8, 35, 2520, 2520, 1, 163, layers_per_virtual=1),
    _sc21("1008B", 128, 25600, 160, 8, 64, 3072, 3072, 1, 163),
    _mcore("1.7B", 24, 2048, 16, 1, 1, 192, 408.8),
    _mcore("7.1B", 30, 4096, 32, 2, 1, 192, 465.9),
    _mcore("16B", 32, 6144, 48, 4, 1, 192, 489.1),
    _mcore("32B", 48, 7168, 56, 8, 1, 192, 459.6),
    _mcore("70B", 84, 8192, 64, 8, 2, 384, 419.7),
    _mcore("119B", 92, 10240, 80, 8, 4, 768, 420.5),
    _mcore("177B", 96, 12288, 96, 8, 6, 1152, 432.8),
    _mcore("314B", 96, 16384, 128, 8, 8, 1536, 474.4),
    _mcore("462B", 112, 18432, 144, 8, 16, 3072, 459.9),
)

LLAMA31_8B_SOURCE = (
    "Megatron-LM training Llama-3.1-8B on 8 x H100 94 GB (93.6 GiB as CUDA reports it), as docs/memory.md "
    "and tests/unit/test_memory_cli.py record it; the original report is not in this repository"
)


@dataclass(frozen=True)
class MemoryRun:
    """A layout that trained without running out of memory, whose throughput is not used here."""

    name: str
    source: str
    num_gpus: int
    device_memory_gib: float
    flags: tuple[str, ...]  # pretrain_llama.py flags of the run


def _llama31_8b(seq: int, mbs: int) -> MemoryRun:
    flags = (
        "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 8 --vocab-size 128256 --bf16 --tensor-model-parallel-size 2 "
        f"--sequence-parallel --use-distributed-optimizer --global-batch-size 128 --seq-length {seq} "
        f"--micro-batch-size {mbs}"
    ).split()
    return MemoryRun(f"Llama-3.1-8B s{seq} mbs{mbs}", LLAMA31_8B_SOURCE, 8, 93.6, tuple(flags))


MEMORY_RUNS = (_llama31_8b(16384, 1), _llama31_8b(8192, 2))
