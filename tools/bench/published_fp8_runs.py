"""Published FP8 training throughputs (H100, dense models) the step-time model's FP8 GEMM rate is fitted on.

Every row is an FP8 run with its whole layout published (GPUs, tp, pp, cp, virtual stages, micro and global
batch, sequence length) and its measured step time or tokens/s per GPU; the rows are flags of our trainer
with `--fp8-format hybrid` and the recipe the source ran. Three sources (tools/bench/planner_calibration.py
`--leave-one-source-out --held-out FP8` fits on two and predicts the third):

* NVIDIA dgxc-benchmarking v25.01 (commit 143b90d), the FP8 tables beside the BF16 ones that
  published_runs.py `DGXC` pins: Llama 3.1 8B, 70B, 405B (NeMo 24.09), GPT-3 175B and Nemotron-4 340B
  (NeMo 24.11), each weak-scaled with the layout of its BF16 table (training step seconds).
* NeMo 24.07 performance summary (github.com/NVIDIA/NeMo, commit 070a0bb,
  docs/source/performance/performance_summary.md), "pre-training performance ... at FP8 precision",
  DGX-H100: tokens/s per GPU and the layout of each row.
* Megatron-Bridge 25.11 performance summary (github.com/NVIDIA-NeMo/Megatron-Bridge, commit 00b7660,
  docs/performance-summary.md), DGX-H100, FP8-CS (current scaling: our tensorwise): tokens/s per GPU.

Assumed for all (not in the tables; as published_runs.py assumes for NVIDIA's BF16 recipes): Megatron-Core
with Transformer Engine, the distributed optimizer with overlapped reduce-scatter and all-gather, bf16
gradient reduction, sequence parallelism, fused attention, no recomputation unless the row's model says so,
the hybrid format (e4m3 forward, e5m2 gradients). NeMo 24.07 / 24.09 / 24.11 ran TE's delayed scaling (NeMo's
defaults: an amax history of 1024, the max of it), Megatron-Bridge's FP8-CS current (tensorwise) scaling.

Left out: the NeMo 24.07 Nemotron-8B and -22B rows (their shapes are not published beside them),
Megatron-Bridge's H100 Llama-3 8B row (the table says Megatron-FSDP; the recipe file at commit 00919dc
recomputes 5 layers and does not set FSDP: the layout is not pinned down), its MoE rows (grouped GEMMs, whose
FP8 path our trainer refuses) and its Blackwell rows (the BF16 model has no Blackwell row to stand on).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tools.bench.published_runs import GPT3_175B, LLAMA31_70B, LLAMA31_405B_DGXC, NEMOTRON4_340B, PublishedRun, words

DGXC_FP8 = (
    "NVIDIA dgxc-benchmarking v25.01 FP8 (github.com/NVIDIA/dgxc-benchmarking, commit 143b90d): the FP8 tables of "
    "llama3.1/README_8b.md, README_70b.md, README_405b.md (NeMo 24.09), nemo_megatron/README_175b.md and "
    "nemotron/README_340b.md (NeMo 24.11): training step seconds, the layouts of the BF16 tables beside them"
)
NEMO_2407 = (
    "NeMo 24.07 performance summary FP8 (github.com/NVIDIA/NeMo, commit 070a0bb, "
    "docs/source/performance/performance_summary.md): DGX-H100 pre-training at FP8, tokens/s per GPU"
)
BRIDGE_2511 = (
    "Megatron-Bridge 25.11 performance summary FP8 (github.com/NVIDIA-NeMo/Megatron-Bridge, commit 00b7660, "
    "docs/performance-summary.md): DGX-H100, FP8-CS, tokens/s per GPU"
)
# NeMo's FP8 defaults (TE DelayedScaling: amax history 1024, its max) and Megatron-Bridge's current scaling
DELAYED = ("--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "1024")
DELAYED += ("--fp8-amax-compute-algo", "max")
TENSORWISE = ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")

LLAMA31_8B = words(
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 --vocab-size 128256"
)
LLAMA2 = "--seq-length 4096 --max-position-embeddings 4096 --vocab-size 32000"
LLAMA2_7B = words(f"--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 {LLAMA2}")
LLAMA2_13B = words(f"--num-layers 40 --hidden-size 5120 --ffn-hidden-size 13824 --num-attention-heads 40 {LLAMA2}")
LLAMA2_70B = words(
    "--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 --group-query-attention "
    f"--num-query-groups 8 {LLAMA2}"
)
# NeMo's GPT-3 5B and 20B (NeMo-Framework-Launcher conf/training/gpt3/5b.yaml, 20b.yaml): GPT-2 BPE, dropout 0.1
GPT3 = "--seq-length 2048 --max-position-embeddings 2048 --vocab-size 50257"
GPT3_5B = words(f"--num-layers 24 --hidden-size 4096 --ffn-hidden-size 16384 --num-attention-heads 32 {GPT3}")
GPT3_20B = words(f"--num-layers 44 --hidden-size 6144 --ffn-hidden-size 24576 --num-attention-heads 48 {GPT3}")


def _fp8_run(
    name, source, shape, gpus, tp, pp, cp, vp, mbs, gbs, metric, published, recipe, family="llama", extra=(), **kw
):
    """One published FP8 row in our trainer's flags (the assumptions in the module docstring); `extra`: more
    flags, `kw`: more PublishedRun fields (`interleave`: virtual stages our trainer cannot lay out)."""
    flags = list(shape) + ["--bf16", *recipe]
    flags += ["--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp, "--context-parallel-size", cp]
    flags += ["--micro-batch-size", mbs, "--global-batch-size", gbs, "--use-distributed-optimizer", *extra]
    flags += ["--sequence-parallel"] if tp > 1 else []
    flags += ["--num-virtual-stages-per-pipeline-rank", vp] if vp > 1 and "interleave" not in kw else []
    return PublishedRun(
        name,
        source,
        "h100-80gb",
        gpus,
        tuple(map(str, flags)),
        "flash",
        metric,
        published,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        grad_dtype=torch.bfloat16,
        family=family,
        **kw,
    )


def _dgxc(name, shape, gpus, tp, pp, cp, vp, gbs, seconds, family="llama"):
    return _fp8_run(f"DGXC FP8 {name} {gpus}", DGXC_FP8, shape, gpus, tp, pp, cp, vp, 1, gbs, "step_s", seconds,
                    DELAYED, family)  # fmt: skip


def _nemo(name, shape, gpus, gbs, mbs, tp, pp, cp, vp, tokens, family="llama"):
    return _fp8_run(f"NeMo24.07 FP8 {name} {gpus}", NEMO_2407, shape, gpus, tp, pp, cp, vp, mbs, gbs,
                    "tokens_per_gpu", tokens, DELAYED, family)  # fmt: skip


DGXC_FP8_RUNS = (
    *(_dgxc("Llama3.1-8B", LLAMA31_8B, g, 1, 1, 2, 1, 16 * g, t) for g, t in
      ((8, 9.67), (16, 9.73), (32, 9.75), (64, 9.80), (128, 9.82))),
    *(_dgxc("Llama3.1-70B", LLAMA31_70B, g, 4, 4, 2, 5, 2 * g, t) for g, t in
      ((64, 11.01), (128, 10.93), (256, 11.16), (512, 11.18), (1024, 11.28), (2048, 11.39))),
    *(_dgxc("Llama3.1-405B", LLAMA31_405B_DGXC, g, 8, 9, 2, 7, g * 252 // 576, t) for g, t in
      ((576, 11.24), (1152, 11.31), (2304, 12.35))),
    *(_dgxc("GPT3-175B", GPT3_175B, g, 4, 8, 1, 12, 2 * g, t, family="gpt") for g, t in
      ((128, 5.92), (256, 5.96), (512, 6.44), (1024, 6.72), (2048, 6.24))),
    *(_dgxc("Nemotron4-340B", NEMOTRON4_340B, g, 8, 8, 1, 12, g // 4, t, family="gpt") for g, t in
      ((128, 3.16), (256, 3.21), (512, 3.26), (1024, 3.34), (2048, 3.49))),
)  # fmt: skip

NEMO_2407_RUNS = (
    _nemo("GPT3-5B", GPT3_5B, 64, 2048, 4, 1, 1, 1, 1, 22521, family="gpt"),
    _nemo("GPT3-20B", GPT3_20B, 64, 256, 2, 2, 1, 1, 1, 5851, family="gpt"),
    _nemo("GPT3-175B", GPT3_175B, 128, 256, 1, 4, 8, 1, 6, 726, family="gpt"),
    _nemo("GPT3-175B", GPT3_175B, 512, 2048, 2, 4, 8, 1, 6, 782, family="gpt"),
    _nemo("Llama2-7B", LLAMA2_7B, 8, 128, 1, 1, 1, 1, 1, 16847),
    _nemo("Llama2-13B", LLAMA2_13B, 16, 128, 1, 1, 4, 1, 10, 8646),
    _nemo("Llama2-70B", LLAMA2_70B, 64, 128, 1, 4, 4, 1, 20, 1707),
    _nemo("Nemotron4-340B", NEMOTRON4_340B, 128, 32, 1, 8, 8, 1, 12, 322, family="gpt"),
    _nemo("Llama3-8B", LLAMA31_8B, 8, 128, 1, 1, 1, 2, 1, 12036),
    _nemo("Llama3-70B", LLAMA31_70B, 64, 128, 1, 4, 4, 2, 5, 1533),
)

# Llama 3 70B (t4 p8 v5, 64 GPUs, global batch 128) and Llama 3.1 405B (t8 p8 c2 v8, 1024 GPUs, global batch 512):
# 126 layers on 64 chunks is Megatron-Bridge's split with the embedding and the loss each counted as a layer
# (assumed, as the Llama 3 paper's and the MoE Model Zoo's rows: 15 layers on the first and last ranks, 16 on the
# others, 8 chunks each: a split our trainer cannot lay out, projected with `interleave`)
BRIDGE_2511_RUNS = (
    _fp8_run("Bridge25.11 FP8-CS Llama3-70B 64", BRIDGE_2511, LLAMA31_70B, 64, 4, 8, 1, 5, 1, 128,
             "tokens_per_gpu", 1602, TENSORWISE),
    _fp8_run("Bridge25.11 FP8-CS Llama3.1-405B 1024", BRIDGE_2511, words(
        "--num-layers 126 --hidden-size 16384 --ffn-hidden-size 53248 --num-attention-heads 128 "
        "--group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 "
        "--vocab-size 128256"), 1024, 8, 8, 2, 8, 1, 512, "tokens_per_gpu", 292, TENSORWISE,
        extra=("--decoder-first-pipeline-num-layers", 15, "--decoder-last-pipeline-num-layers", 15), interleave=8),
)  # fmt: skip

FP8_RUNS = DGXC_FP8_RUNS + NEMO_2407_RUNS + BRIDGE_2511_RUNS


def bf16_twin(run: PublishedRun) -> PublishedRun:
    """The same row without its FP8 flags (a BF16 run of the same layout)."""
    fp8 = {i + j for i, flag in enumerate(run.flags) if flag.startswith("--fp8-") for j in (0, 1)}  # flag, value
    kept = tuple(flag for i, flag in enumerate(run.flags) if i not in fp8)
    return replace(run, name=f"{run.name} as BF16", flags=kept)
