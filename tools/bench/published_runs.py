"""Published training throughputs the step-time model is calibrated and checked against.

Each row is a run that really happened, in pretrain_gpt.py / pretrain_llama.py flags, with the
figure its authors published (TFLOP/s per GPU, or seconds per iteration). `RUNS`, the
calibration set, holds two sources:

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
  names), tensor-parallel communication overlapped with the GEMMs (the README: "TP
  (`--tp-comm-overlap`)"). Reported: model TFLOP/s per GPU.
  Micro batch and virtual stages are not published: the planner picks them (its fastest
  layout that fits among micro batch 1, 2, 4 and every valid virtual-stage count).

`EXTRA_RUNS`, three more sources, out of the default fit; `--leave-one-source-out`
(tools/bench/planner_calibration.py) fits on all sources but one and predicts the one left out:

* Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
  Tables 3 and 5: 22B-1T on 8-512 A100s without data parallelism, full recomputation vs
  sequence parallelism with selective recomputation (iteration seconds), and Section 6.3's
  530B on 2240 GPUs (dp 8). Published: the whole layout; assumed: see `_korthikanti`.
* NVIDIA dgxc-benchmarking v25.01 (DGX Cloud benchmark recipes, NeMo 24.05/24.09 on DGX H100,
  BF16): GPT-3 175B, Llama 3.1 70B and 405B, Nemotron-4 340B, each weak-scaled over 64-2304
  GPUs (training step seconds); the layouts and every setting are in the recipes' YAML files.
* Llama 3 405B (Llama Team 2024, Table 4): 8,192 and 16,384 H100s at 8K context, 16,384 at
  128K with cp 16 (model TFLOP/s per GPU). Published: tp, cp, pp, dp, sequences per dp rank;
  the rest from Section 3.3.2 and assumed: see `_llama3`. The interleaved schedule (one layer
  per chunk, the embedding and output layer in chunks of their own) is one our trainer cannot
  lay out; the projection runs it (`interleave`), the memory estimate is skipped.

`MOE_RUNS`, MoE training, two sources, BF16 on H100 with ep 8 inside a node: the Megatron MoE Model Zoo's
Qwen3-235B-A22B on 256 GPUs (see `_moe_zoo`; the two rows the MoE constant r0,
compute_cost.Calibration.expert_rows_half, was fitted on alone) and its Mixtral-8x22B on 128
(`_zoo_mixtral_8x22b`), and NeMo Automodel's Qwen3-30B-A3B on 8 (`_automodel_qwen3_30b`); the MoE rows
searched for and left out are in docs/planner.md ("Mixture of experts").

Left out, the layout not pinned down: MegaScale (Jiang et al. 2024) Table 2's Megatron-LM
baseline (micro batch, recomputation, optimizer sharding, attention kernel, GPU memory and
network of its "Ampere GPUs" unpublished); BLOOM-176B (ALiBi, Omni-Path network with 4
links per 8-GPU node, CUDA_LAUNCH_BLOCKING=1: outside what the model describes); NeMo's
performance tables (FP8 only for dense models on H100: rows of tools/bench/published_fp8_runs.py).
No second source of BF16 throughput at long context (16K and more, context parallelism) from a
Megatron-based stack was found: NeMo's long-sequence tables are FP8, Megatron-Bridge's summaries
stop at 8K for dense models, the rest lacks an absolute figure or a layout (what was searched, and
why each is out: docs/planner.md, "Searched for and not found"), so Llama 3's 128K row is the only
long-context row.
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
    metric: str  # "hardware" (recomputation counted) or "model" TFLOP/s per GPU, or "step_s": seconds per iteration
    published: float  # the figure as published, in the metric's unit
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    searched: bool = False  # micro batch and virtual stages not published: the planner picks them
    grad_dtype: torch.dtype = torch.float32  # gradient buffer element: Megatron-Core's default holds bf16 gradients
    family: str = "gpt"  # pretrain_gpt.py or pretrain_llama.py defaults
    # virtual stages of an interleaved schedule our trainer cannot lay out (a rank's layers not divisible
    # by them: Llama 3's 7-layer first and last stages in 8 chunks, one of them the embedding or the
    # output layer alone): the projection runs the schedule with them, the memory estimate is skipped
    interleave: int | None = None
    # what the run's framework did differently from our trainer (megatron/planning/step_time.py Practice)
    cp_all_gather: bool = False  # K and V all-gathered before attention, on the critical path (no ring)
    regather_params: bool = False  # the parameter all-gather before every microbatch's forward


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

KORTHIKANTI = (
    "Korthikanti et al., Reducing Activation Recomputation in Large Transformer Models (MLSys 2023, "
    "arXiv 2205.05198): Table 3 (layouts), Table 5 (iteration seconds), Section 6.3 (the 530B model on 2240 GPUs)"
)
DGXC = (
    "NVIDIA dgxc-benchmarking v25.01 (github.com/NVIDIA/dgxc-benchmarking, commit 143b90d): the BF16 tables "
    "of nemo_megatron/README_175b.md, llama3.1/README_70b.md, llama3.1/README_405b.md and "
    "nemotron/README_340b.md (training step seconds), layouts from the YAML configs beside them"
)
LLAMA3 = "Llama 3 405B (Llama Team, The Llama 3 Herd of Models, arXiv 2407.21783): Table 4 and Section 3.3.2"


def _korthikanti(name, layers, hidden, heads, pp, gpus, gbs, mbs, seconds, present, virtual=None):
    """Table 3's layouts (tp 8, no data parallelism except the 2240-GPU row) with Table 5's iteration
    seconds: "Full Recompute" (no sequence parallelism, every layer recomputed: as SC21) or "Present
    Work" (sequence parallelism and selective recomputation). A100 80 GB (Selene), seq 2048, vocab
    51,200, interleaving with 3 stages for the 175B and 530B models. Assumed, as SC21: fp16, GPT-3
    layers with dropout 0.1 and the unfused attention of the time, the replicated optimizer, fp32
    gradients reduced after the backward (Section 6.3: "we do not use any overlapping of gradient
    all-reduces with back-propagation")."""
    flags = [
        "--num-layers", layers, "--hidden-size", hidden, "--num-attention-heads", heads,
        "--seq-length", 2048, "--max-position-embeddings", 2048, "--vocab-size", 51200, "--fp16",
        "--tensor-model-parallel-size", 8, "--pipeline-model-parallel-size", pp,
        "--micro-batch-size", mbs, "--global-batch-size", gbs,
    ]  # fmt: skip
    if present:
        flags += ["--sequence-parallel", "--recompute-granularity", "selective"]
    else:
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1]
    if virtual:
        flags += ["--num-virtual-stages-per-pipeline-rank", virtual]
    return PublishedRun(
        f"Korthikanti {name} {'sel+SP' if present else 'full'}",
        KORTHIKANTI,
        "a100-80gb",
        gpus,
        tuple(map(str, flags)),
        "math",
        "step_s",
        seconds,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
    )


def _dgxc(name, gpus, gbs, seconds, shape, tp, pp, vp, cp=1, family="gpt"):
    """A DGX Cloud benchmark recipe on DGX H100 (NeMo 24.05 / 24.09: Megatron-Core with Transformer
    Engine), BF16, micro batch 1: the distributed optimizer (distributed_fused_adam) with overlapped
    gradient reduce-scatter and parameter all-gather and bf16 gradient reduction (grad_sync_dtype),
    sequence parallelism, fused / flash attention, and (GPT-3, Llama 3.1: ub_tp_comm_overlap; not Nemotron-4)
    Transformer Engine's overlap of the tensor-parallel collectives with the GEMMs. Weak scaling: the
    batch grows with the GPUs."""
    flags = list(shape) + [
        "--bf16", "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp,
        "--context-parallel-size", cp, "--num-virtual-stages-per-pipeline-rank", vp,
        "--micro-batch-size", 1, "--global-batch-size", gbs, "--sequence-parallel", "--use-distributed-optimizer",
    ]  # fmt: skip
    return PublishedRun(
        f"DGXC {name} {gpus}",
        DGXC,
        "h100-80gb",
        gpus,
        tuple(map(str, flags)),
        "flash",
        "step_s",
        seconds,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        grad_dtype=torch.bfloat16,
        family=family,
    )


def words(text: str) -> list[str]:
    return text.split()


# GPT-3 175B (gpt3_175b_hydra.yaml, NeMo 24.05): GPT2BPETokenizer (50,257 tokens), dropout 0.1, tied embeddings
GPT3_175B = words(
    "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
    "--max-position-embeddings 2048 --vocab-size 50257"
)
# Llama 3.1 70B (llama3.1_70b.yaml, NeMo 24.09): the Llama 3 tokenizer
LLAMA31_70B = words(
    "--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 --group-query-attention "
    "--num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 --vocab-size 128256"
)
# Llama 3.1 405B (llama3.1_405b.yaml, NeMo 24.09): 16 query groups and the GPT2BPETokenizer "as a proxy", as configured
LLAMA31_405B_DGXC = words(
    "--num-layers 126 --hidden-size 16384 --ffn-hidden-size 53248 --num-attention-heads 128 "
    "--group-query-attention --num-query-groups 16 --seq-length 8192 --max-position-embeddings 8192 --vocab-size 50257"
)
# Nemotron-4 340B (nemotron4-340b-synth.yaml): layernorm1p (LayerNorm), squared ReLU (two matrices, as GELU),
# rope, no bias, untied, 8 query groups, vocab 256,000, no dropout; selective recomputation, no tp overlap
NEMOTRON4_340B = words(
    "--num-layers 96 --hidden-size 18432 --ffn-hidden-size 73728 --num-attention-heads 96 --group-query-attention "
    "--num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096 --vocab-size 256000 "
    "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
    "--attention-dropout 0 --hidden-dropout 0 --recompute-granularity selective"
)


def _llama3(name, gpus, cp, dp, seq, batch_per_dp, tflops):
    """Table 4: Llama 3 405B on H100 80 GB (Grand Teton, 400 Gb/s RoCE per GPU: the h100-80gb preset's
    network), BF16 model TFLOP/s per GPU (MFU as Chowdhery et al. count it: full attention, as ours).
    Published: tp, cp, pp, dp, sequence length, sequences per dp rank. From Section 3.3.2: FSDP sharding
    the optimizer states and gradients, with "model shards" not resharded after the forward "to avoid
    an extra all-gather communication during backward passes", weights prefetched and gradients
    reduced asynchronously ("asynchronously prefetching sharded model weights and reducing
    gradients"), FP32 gradient accumulation over the microbatches and FP32 reduce-scatter:
    projected as the distributed optimizer, FP32 gradients reduce-scattered once a step, whose
    parameter all-gather runs before every microbatch's forward (`regather_params`), each hidden
    behind the forward it feeds. How many gathers a step is not published: one per microbatch is
    what FSDP2 does with reshard_after_forward=False while gradient sync is off (parameters
    resharded after each backward: reshard_after_backward stays on); the alternatives bracket the
    8K rows (parameters kept gathered the whole step, as torch.distributed.pipelining asks of FSDP2:
    over-predicted by 13-23%; gradients reduce-scattered every microbatch too: under-predicted by
    26-27%; docs/planner.md), no activation checkpointing at 8K, one layer fewer on the first and
    last stages and an interleaved schedule whose first chunk is the embedding alone and last the
    output layer alone: 126 layers + 2 = 16 ranks x 8 chunks of one layer; context parallelism by all-gathering K and V
    before attention, not a ring: "the all-gather communication latency is exposed in the critical
    path" (`cp_all_gather`: the ring's bytes, K/V forward and their gradients backward, none hidden;
    the paper calls it small next to the attention at 128K, which the projection agrees with: 0.6 s
    of a 13-17 s step). Assumed: micro batch 1 (so the sequences per dp rank are the microbatches),
    8 virtual stages (the only count giving every chunk the same layers), no recomputation at 128K
    either (a cp rank holds 8K tokens, as at 8K), flash attention. The 128K row's dp is 8: the table
    prints 4, but its 16,384 GPUs = 8 x 16 x 16 x dp and its 16M tokens per batch = dp x 16 x
    131,072 both give 8."""
    flags = [
        "--num-layers", 126, "--hidden-size", 16384, "--ffn-hidden-size", 53248, "--num-attention-heads", 128,
        "--group-query-attention", "--num-query-groups", 8, "--seq-length", seq, "--max-position-embeddings", seq,
        "--vocab-size", 128256, "--bf16", "--tensor-model-parallel-size", 8, "--pipeline-model-parallel-size", 16,
        "--context-parallel-size", cp, "--decoder-first-pipeline-num-layers", 7,
        "--decoder-last-pipeline-num-layers", 7, "--micro-batch-size", 1, "--global-batch-size", dp * batch_per_dp,
        "--sequence-parallel", "--use-distributed-optimizer",
    ]  # fmt: skip
    return PublishedRun(
        f"Llama3 {name}",
        LLAMA3,
        "h100-80gb",
        gpus,
        tuple(map(str, flags)),
        "flash",
        "model",
        tflops,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        family="llama",
        interleave=8,
        cp_all_gather=True,
        regather_params=True,
    )


# Held out of the default fit: other sources, sizes, GPU counts, context lengths (planner_calibration.py
# --leave-one-source-out fits on every source but one and predicts the one left out)
EXTRA_RUNS = (
    _korthikanti("22B", 48, 6144, 64, 1, 8, 4, 4, 1.42, present=False),
    _korthikanti("175B", 96, 12288, 96, 8, 64, 64, 1, 18.13, present=False, virtual=3),
    _korthikanti("530B", 105, 20480, 128, 35, 280, 280, 1, 49.05, present=False, virtual=3),
    _korthikanti("1T", 128, 25600, 160, 64, 512, 512, 1, 94.42, present=False),
    _korthikanti("22B", 48, 6144, 64, 1, 8, 4, 4, 1.10, present=True),
    _korthikanti("175B", 96, 12288, 96, 8, 64, 64, 1, 13.75, present=True, virtual=3),
    _korthikanti("530B", 105, 20480, 128, 35, 280, 280, 1, 37.83, present=True, virtual=3),
    _korthikanti("1T", 128, 25600, 160, 64, 512, 512, 1, 71.49, present=True),
    _korthikanti("530B dp8", 105, 20480, 128, 35, 2240, 2240, 1, 39.15, present=True, virtual=3),
    *(_dgxc("GPT3-175B", g, 2 * g, t, GPT3_175B, 4, 8, 12) for g, t in
      ((128, 8.309), (256, 8.408), (512, 8.42), (1024, 8.453), (2048, 8.49))),
    *(_dgxc("Llama3.1-70B", g, 2 * g, t, LLAMA31_70B, 4, 4, 5, cp=2, family="llama") for g, t in
      ((64, 14.72), (128, 14.73), (256, 14.8), (512, 14.89), (1024, 14.92), (2048, 14.98))),
    *(_dgxc("Llama3.1-405B", g, g * 252 // 576, t, LLAMA31_405B_DGXC, 8, 9, 7, cp=2, family="llama") for g, t in
      ((576, 17.20), (1152, 17.52), (2304, 17.62))),
    *(_dgxc("Nemotron4-340B", g, g // 4, t, NEMOTRON4_340B, 8, 8, 12) for g, t in
      ((128, 4.61), (256, 4.67), (512, 4.7), (1024, 4.73), (2048, 4.84))),
    _llama3("405B 8K 8192", 8192, 1, 64, 8192, 32, 430),
    _llama3("405B 8K 16384", 16384, 1, 128, 8192, 16, 400),
    _llama3("405B 128K 16384", 16384, 16, 8, 131072, 16, 380),
)  # fmt: skip

MOE_ZOO = (
    "Megatron MoE Model Zoo (github.com/yanring/Megatron-MoE-ModelZoo): commit c1ad0b5 best_practice/Qwen3/readme.md "
    "(per-GPU TFLOP/s, step seconds, layouts), model_configs/benchmarking/Qwen3-235B-A22B.yaml (every flag); commit "
    "e865051 best_practice/mixtral/run_mixtral_8x22B.sh (TFLOP/s), runtime_configs/benchmarking/runtime.conf "
    "(layout), model_configs/benchmarking/Mixtral-8x22B.yaml (every flag)"
)


def _qwen3_moe_flags(layers, hidden, ffn, heads, expert_ffn, ep):
    """The model flags both Qwen3-MoE rows share (their Hugging Face configs): heads of 128, 4 query groups,
    seq 4096, vocabulary 151,936 untied, no biases or dropout, bf16, 128 experts top-8 as a grouped GEMM
    behind the all-to-all dispatcher, ep experts-parallel ranks without expert tensor parallelism."""
    return [
        "--num-layers", layers, "--hidden-size", hidden, "--ffn-hidden-size", ffn, "--num-attention-heads", heads,
        "--kv-channels", 128, "--group-query-attention", "--num-query-groups", 4, "--seq-length", 4096,
        "--max-position-embeddings", 4096, "--vocab-size", 151936, "--untie-embeddings-and-output-weights",
        "--attention-dropout", 0, "--hidden-dropout", 0, "--disable-bias-linear", "--bf16",
        "--num-experts", 128, "--moe-ffn-hidden-size", expert_ffn, "--moe-router-topk", 8, "--moe-grouped-gemm",
        "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", ep,
        "--expert-tensor-parallel-size", 1,
    ]  # fmt: skip


def _moe_zoo(dispatcher, tp, ep, pp, vpp, tflops):
    """Qwen3-235B-A22B on 256 H100 80 GB (NVLink 4, 8 x 50 GB/s InfiniBand per node), BF16, Megatron-Core,
    seq 4096, micro batch 1, global batch 2048, dropless routing (not force-balanced). Published: tp, ep,
    pp, vpp, etp 1, the dispatcher, recomputation. From the model config: the distributed optimizer with
    overlapped reduce-scatter and all-gather, sequence parallelism, flash attention, the fused cross entropy,
    grouped GEMM, the embedding and the loss each counted as a layer in the pipeline split (94 layers + 2 =
    pp x vpp chunks: the first and last stages one layer fewer per chunk holding them, a split our trainer
    cannot lay out: `interleave`). Left as ours: Megatron-Core's bf16 gradient buffer kept (its default),
    qk-layernorm left out (two per-head norms, elementwise), DeepEP ("flex") projected as our all-to-all
    with the same token bytes (DeepEP sends a token once per node, not once per expert: fewer network
    bytes than projected), the recomputation of the norms and the experts' activation ("norm, act": an
    extra elementwise pass) not projected."""
    per_stage, name = 96 // pp, f"t{tp} e{ep} p{pp} v{vpp}"
    flags = _qwen3_moe_flags(layers=94, hidden=4096, ffn=12288, heads=64, expert_ffn=1536, ep=ep) + [
        "--tensor-model-parallel-size", tp, "--sequence-parallel",
        "--pipeline-model-parallel-size", pp, "--decoder-first-pipeline-num-layers", per_stage - 1,
        "--decoder-last-pipeline-num-layers", per_stage - 1, "--micro-batch-size", 1, "--global-batch-size", 2048,
        "--use-distributed-optimizer", "--cross-entropy-loss-fusion",
    ]  # fmt: skip
    return PublishedRun(
        f"MoE-Zoo Qwen3-235B {dispatcher} {name}",
        MOE_ZOO,
        "h100-80gb",
        256,
        tuple(map(str, flags)),
        "flash",
        "model",
        tflops,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        grad_dtype=torch.bfloat16,
        family="llama",
        interleave=vpp,
    )


def _zoo_mixtral_8x22b():
    """Mixtral-8x22B on 128 H100 80 GB (16 nodes), BF16, Megatron-Core, the model zoo's benchmark layout
    (runtime_configs/benchmarking/runtime.conf: tp 2, pp 8, ep 8, cp 1, vpp 7, micro batch 1, global batch 256,
    seq 4096, alltoall, grouped GEMM, 16 nodes) and its figure for dropless training, not force-balanced
    (best_practice/mixtral/run_mixtral_8x22B.sh: "around 445 TFLOPS"; 455 at the older commit 0993e66). From
    the model config: 56 layers of hidden 6144, 48 heads, 8 query groups, 8 experts of 16384, top-2, untied
    embeddings, the distributed optimizer with overlapped reduce-scatter and all-gather, sequence parallelism,
    tensor-parallel communication overlap, flash attention, no recomputation. Assumed: vocabulary 32,000 (the
    Llama-2 tokenizer of Mistral's v0.1 release); left as ours: Megatron-Core's bf16 gradient buffer kept, its
    fused permutation and router kernels (`--moe-permute-fusion`, `--moe-router-fusion`) as our permutation."""
    flags = [
        "--num-layers", 56, "--hidden-size", 6144, "--ffn-hidden-size", 16384, "--num-attention-heads", 48,
        "--group-query-attention", "--num-query-groups", 8, "--seq-length", 4096, "--max-position-embeddings", 4096,
        "--vocab-size", 32000, "--untie-embeddings-and-output-weights", "--attention-dropout", 0,
        "--hidden-dropout", 0, "--disable-bias-linear", "--bf16", "--num-experts", 8, "--moe-ffn-hidden-size", 16384,
        "--moe-router-topk", 2, "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
        "--expert-model-parallel-size", 8, "--expert-tensor-parallel-size", 1, "--tensor-model-parallel-size", 2,
        "--sequence-parallel", "--pipeline-model-parallel-size", 8, "--num-layers-per-virtual-pipeline-stage", 1,
        "--micro-batch-size", 1, "--global-batch-size", 256, "--use-distributed-optimizer",
    ]  # fmt: skip
    return PublishedRun(
        "MoE-Zoo Mixtral-8x22B A2A t2 e8 p8 v7",
        MOE_ZOO,
        "h100-80gb",
        128,
        tuple(map(str, flags)),
        "flash",
        "model",
        445,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        grad_dtype=torch.bfloat16,
        family="llama",
    )


AUTOMODEL = (
    "NeMo Automodel performance summary (docs.nvidia.com/nemo/automodel/nightly/performance-summary.html, the "
    "repository's docs/performance-summary.md): pre-training, DGX-H100, BF16, time per global step and layout"
)


def _automodel_qwen3_30b():
    """Qwen3-30B-A3B ("Qwen3 MoE 30B") on 8 H100 80 GB (one DGX node), BF16, NeMo Automodel (PyTorch FSDP2
    with expert parallelism): global batch 512, local batch 4 (16 accumulation steps), seq 4096, tp 1, pp 1,
    cp 1, ep 8, FSDP over the 8 GPUs, TE + DeepEP; 21.773 s per global step (277 model TFLOP/s, 12,040
    tokens/s per GPU: 512 x 4096 / 8 / 21.773). The model (its Hugging Face config): 48 layers of hidden 2048,
    32 heads of 128 (query width 4096), 4 query groups, 128 experts of 768, top-8, vocabulary 151,936, untied
    embeddings. Projected as ours: FSDP as `optim_grads_params` sharding with the parameters gathered again
    for every microbatch (FSDP2's default reshards after forward), DeepEP inside one node as our all-to-all
    (the same NVLink bytes), the experts as our grouped GEMM. Not published and assumed: no activation
    recomputation, gradients reduced in bf16, the reduce-scatter and all-gather overlapped with computation;
    qk-layernorm left out (two per-head norms, elementwise)."""
    flags = _qwen3_moe_flags(layers=48, hidden=2048, ffn=6144, heads=32, expert_ffn=768, ep=8) + [
        "--micro-batch-size", 4, "--global-batch-size", 512,
        "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
    ]  # fmt: skip
    return PublishedRun(
        "Automodel Qwen3-30B-A3B e8 fsdp8",
        AUTOMODEL,
        "h100-80gb",
        8,
        tuple(map(str, flags)),
        "flash",
        "step_s",
        21.773,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        grad_dtype=torch.bfloat16,
        family="llama",
        regather_params=True,
    )


# MoE training runs (BF16, H100) whose layout is published, ep inside a node (NVLink). Left out (docs/planner.md):
# the same table's ep 32 row across 4 nodes with DeepEP (245 TFLOP/s): DeepEP sends a token once per node and
# forwards it over NVLink there, not our all-to-all (projected as ours: 38 s for the published 19.7 s), and its
# rows with the all-to-all overlapped with computation ("1f1b overlap") or Megatron-FSDP.
# MOE_FIT_RUNS: the rows the default r0 (compute_cost.Calibration.expert_rows_half) was fitted on;
# MOE_CHECK_RUNS: two more models, one of them from a second source, added after that fit to check it (the model
# projects both about 21% slow: docs/planner.md); `fit` over ALL_RUNS and the leave-one-source-out take all four.
MOE_FIT_RUNS = (
    _moe_zoo("A2A", 2, 8, 32, 3, 200),
    _moe_zoo("DeepEP", 4, 8, 8, 4, 167),
)
MOE_CHECK_RUNS = (_zoo_mixtral_8x22b(), _automodel_qwen3_30b())
MOE_RUNS = MOE_FIT_RUNS + MOE_CHECK_RUNS
ALL_RUNS = RUNS + EXTRA_RUNS + MOE_RUNS
SOURCES = tuple(dict.fromkeys(run.source for run in ALL_RUNS))
