"""Published memory outcomes the fit rule is checked against: layouts that trained (with the memory
measured, where published) and layouts that ran out of memory.

`MEMORY_RUNS` (checked by tools/bench/fit_rule_outcomes.py; no throughput here: the step-time model's
rows are in published_runs.py): Llama-3.1-8B on H100 94 GB
(both ran), and BigScience's search for the BLOOM-176B layout on 48 nodes of 8 x A100 80 GB
(Jean Zay), in its chronicle bigscience-workshop/bigscience train/tr11-176B-ml/chronicles-prequel.md:
every row of the sections of 02-25 and 02-28 (the two with out-of-memory rows), 38 that ran and 6
that ran out of memory. See `_bigscience` for what is published and what is assumed. And
out-of-memory reports of Megatron-LM itself (`MEGATRON_LM_RUNS`), used only where the report pins
every flag that moves the verdict: NVIDIA/Megatron-LM issue #525 (a 771M GPT on one V100 32 GB; its
script and full argument dump are linked from the issue). Read and left out, a flag that decides the
verdict unknown: #606 (Llama-2-7B, tp 1, pp 1, A100 40 GB: the precision, optimizer and dp flags are
past the part of the script that can be read, and with fp16 and the distributed optimizer over dp 8 or
more the certain part would be under 40 GB, so they decide it), #818 (Llama-3-8B at seq 8192: tp, pp,
micro batch and the GPU not given), #60 (a 2.6B GPT-2 on V100s, January 2021: hidden size, layers,
heads and sequence not in the readable part of its dump, and --distribute-checkpointed-activations and
the local DDP's flattened gradient copy are not ours), #637 (a "GPT-30B" in FP8: tp, pp, shape and the
GPU not given), #1308 and #783 (no flags), #1000 (ran, no memory reported, layer count disputed in
#1308); alibaba/Megatron-LLaMA #11 is another framework (its own overlapped distributed optimizer).
Last, our own trainer's outcomes near a GPU's limit (`own_runs`): the memory_limit section of each GPU check
report committed in docs/gpu-results/ (issue 43; none yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron.planning.hardware import DEVICES
from tools.bench.published_runs import words

LLAMA31_8B_SOURCE = (
    "Megatron-LM training Llama-3.1-8B on 8 x H100 94 GB (93.6 GiB as CUDA reports it), as docs/memory.md "
    "and tests/unit/test_memory_cli.py record it; the original report is not in this repository"
)


@dataclass(frozen=True)
class OtherOptimizer:
    """The optimizer of another framework that a published row ran, where it holds more per parameter than
    what our estimate counts for the same flags: `extra_grad_bytes_per_parameter` bytes for every
    parameter of the rank, alive at the activation peak. tools/bench/fit_rule_outcomes.py adds them to
    the row's gradients (certain memory); the estimator (megatron/planning/) is not changed."""

    name: str
    extra_grad_bytes_per_parameter: int
    source: str  # the code that holds them: repository, file, commit, and what it does


DEEPSPEED_BF16_OPTIMIZER = OtherOptimizer(
    "DeepSpeed BF16_Optimizer (ZeRO-1)",
    2,
    "microsoft/DeepSpeed deepspeed/runtime/bf16_optimizer.py, branch olruwase/bf16-updates at "
    "15293139f7c25a9a7ddbcefcd8bb1d84f4052b2e (2022-02-28; what it allocates is unchanged since "
    "819abe2a7d8ba72c950da11890f565dc3a05385e of 02-24), with deepspeed/runtime/pipe/engine.py of the same "
    "commit. Per parameter group, the constructor packs the bf16 weights into one flat buffer (2 bytes), "
    "allocates an fp32 gradient buffer as long as the whole flat group, the rank's data-parallel partition "
    "being only a view into it (4 bytes, not sharded), and an fp32 copy of the rank's 1/dp slice of the "
    "weights that the wrapped Adam steps, which allocates its two moments on that slice at construction "
    "(12/dp bytes). Backward lets autograd write each weight's bf16 .grad, then adds it, upcast, into the "
    "fp32 buffer and leaves the bf16 .grad in place: the pipeline engine drops the bf16 gradients only just "
    "before the next backward, and the optimizer step does not drop them, so they live through the next "
    "step's forwards, when the activations peak (2 bytes). Ours, for the same flags: bf16 weights 2, fp32 "
    "gradient buffer 4, main parameters and moments 12/dp; the bf16 gradients are the difference. "
    "Megatron-DeepSpeed hands DeepSpeed the bare apex FusedAdam (megatron/optimizer/__init__.py returns it "
    "before Megatron's own fp16/bf16 wrapper when --deepspeed is on; bigscience-workshop/Megatron-DeepSpeed "
    "00f5f8896688efe5dc84c907a812705851ffa440), and BigScience ran it with ZERO_STAGE=0, the BF16 "
    "optimizer doing its own stage-1 sharding (bigscience-workshop/bigscience train/tr11-200B-ml/"
    "tr11-200B-ml.slurm at fd075b7a5240fb5f3c3af6613ef7735fe6146b34). Not counted, transients outside "
    "the activation peak or within our allowances: the fp32 upcast of one weight's gradient while it is "
    "added (at most the embedding's shard), the bf16 copy of each flat fp32 group for its data-parallel "
    "all-reduce (the engine's default communication type for bf16 at stage 0), after the last backward",
)


@dataclass(frozen=True)
class MemoryRun:
    """A layout with a published memory outcome: it trained, or it ran out of memory."""

    name: str
    source: str
    num_gpus: int
    device_memory_gib: float
    flags: tuple[str, ...]  # pretrain_llama.py (family "llama") or pretrain_gpt.py flags of the run
    family: str = "llama"
    oom: bool = False  # the published outcome: out of memory (else it trained)
    grad_dtype: torch.dtype = torch.float32  # the gradient buffer's element
    measured_gb: float | None = None  # the memory the source reports for a run that trained, if any
    # another framework's optimizer that held more per parameter than our estimate counts (None: ours)
    optimizer: OtherOptimizer | None = None


def _llama31_8b(seq: int, mbs: int) -> MemoryRun:
    flags = words(
        "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 8 --vocab-size 128256 --bf16 --tensor-model-parallel-size 2 "
        f"--sequence-parallel --use-distributed-optimizer --global-batch-size 128 --seq-length {seq} "
        f"--micro-batch-size {mbs}"
    )
    return MemoryRun(f"Llama-3.1-8B s{seq} mbs{mbs}", LLAMA31_8B_SOURCE, 8, 93.6, tuple(flags))


BIGSCIENCE = (
    "BigScience, BLOOM-176B layout search on Jean Zay (48 nodes of 8 x A100 80 GB), Megatron-DeepSpeed: "
    "github.com/bigscience-workshop/bigscience train/tr11-176B-ml/chronicles-prequel.md, sections "
    '"GBS Variations" to "NHIDDEN=12288 / NLAYERS=96" (02-25) and "Rebalancing layers" (02-28); flags of the '
    "time in train/tr11-200B-ml/tr11-200B-ml.slurm and train/tr11-176B-ml/tr11-176B-ml.slurm"
)
OOM = None  # a row's measured memory when it ran out of memory


def _bigscience(date, layers, hidden, heads, dp, tp, pp, mbs, gbs, measured_gb) -> MemoryRun:
    """One row of the chronicle's tables (Nodes, DP, TP, PP, MBS, GBS, Mem; NLAYERS / NHIDDEN / NHEADS above
    or beside them), on 384 GPUs. Mem is "OOM" or the most memory a GPU of the first or last node used
    (nvidia-smi, so the caching allocator's reserve and the CUDA context included; "GB" when not read).

    Published: the layout, the model's shape, the sequence (2048) and the 250k vocabulary (padded to
    250,880 in tr11-176B-ml.slurm), and, for 02-28 on, "BF16 optimizer [...] to accumulate gradients
    in fp32 [...] 4 bytes x params [...] not sharded" and `--pp-partition-method
    'type:transformer|embedding'` (the embedding takes a stage's layer slot: (layers + 2) / pp slots,
    one fewer transformer layer on the first and last stage). The scripts of the time: full
    recomputation (--checkpoint-activations, one layer each), ALiBi (no position parameters),
    embedding layer norm, tied embeddings, DeepSpeed ZeRO stage 1 (optimizer state sharded over dp:
    our distributed optimizer), fp16 before 02-28 (tr11-200B-ml.slurm; its 16-bit gradients: the
    gradient buffer is fp16) and bf16 from 02-28 (fp32 gradients). Assumed: GPT-3 layers otherwise as
    pretrain_gpt.py (GELU MLP of 4 h, LayerNorm, biases, dropout 0.1), Megatron-DeepSpeed's unfused
    attention with ALiBi (our "unfused" backend: the s x s scores materialized), the
    default partition ('type:transformer': the layers split evenly) before 02-28. Modelled from
    DeepSpeed's code, on the 02-28 rows only: its BF16_Optimizer keeps every weight's bf16 gradient
    beside the whole fp32 gradient buffer, 2 bytes a parameter of the rank more than ours
    (`DEEPSPEED_BF16_OPTIMIZER`). Not modelled: the rest of DeepSpeed's pipeline engine and optimizers
    (their transient buffers are not ours); the fp16 ZeRO-1 optimizer of 02-25 holds at the activation
    peak what ours counts (fp16 weights and whole fp16 gradients; its fp32 and partition buffers are
    made after the backward)."""
    bf16 = date == "02-28"
    flags = [
        "--num-layers", layers, "--hidden-size", hidden, "--num-attention-heads", heads, "--seq-length", 2048,
        "--max-position-embeddings", 2048, "--vocab-size", 250880, "--position-embedding-type", "none",
        "--bf16" if bf16 else "--fp16", "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp,
        "--micro-batch-size", mbs, "--global-batch-size", gbs, "--use-distributed-optimizer",
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1,
        "--attention-backend", "unfused",
    ]  # fmt: skip
    if bf16 and pp > 1:  # 'type:transformer|embedding'
        slots = (layers + 2) // pp
        flags += ["--decoder-first-pipeline-num-layers", slots - 1, "--decoder-last-pipeline-num-layers", slots - 1]
    return MemoryRun(
        f"BigSci {date} L{layers}/h{hidden}/a{heads} {dp}x{tp}x{pp} m{mbs} g{gbs}",
        BIGSCIENCE,
        dp * tp * pp,
        DEVICES["a100-80gb"].memory_gib,
        tuple(map(str, flags)),
        family="gpt",
        oom=measured_gb is OOM,
        grad_dtype=torch.float32 if bf16 else torch.float16,
        measured_gb=None if measured_gb in (OOM, "GB") else measured_gb,
        optimizer=DEEPSPEED_BF16_OPTIMIZER if bf16 else None,
    )


BIGSCIENCE_RUNS = (
    # 02-25, fp16 and ZeRO-1; NLAYERS=72, NHIDDEN=14336, NHEADS=64 ("GBS Variations", "some more configs with
    # lower PP", "Tweaking TP"): date, layers, hidden, heads, dp, tp, pp, mbs, gbs, Mem
    *(_bigscience("02-25", 72, 14336, 64, *row) for row in (
        (8, 8, 6, 4, 1568, 56), (8, 8, 6, 4, 2048, 55), (8, 8, 6, 6, 2016, 66),
        (4, 8, 12, 4, 1568, "GB"), (4, 8, 12, 4, 2048, 49), (4, 8, 12, 2, 1568, "GB"), (4, 8, 12, 2, 2048, "GB"),
        (6, 8, 8, 4, 2016, 52), (12, 8, 4, 2, 2016, 53), (12, 8, 4, 4, 2016, 59), (24, 8, 2, 1, 2016, 65),
        (24, 8, 2, 2, 2016, 76), (48, 8, 1, 1, 2016, OOM),
        (8, 4, 12, 4, 2048, 60), (8, 4, 12, 2, 2048, 44),  # the table lists the second twice: 44 and 38 GB
        (16, 4, 6, 4, 2048, 75), (16, 4, 6, 2, 2048, 57), (16, 2, 12, 2, 2048, 63),
        (32, 2, 6, 2, 2048, OOM), (32, 2, 6, 1, 2048, OOM),
        (8, 2, 24, 1, 2048, 44), (8, 2, 24, 2, 2048, 53), (4, 4, 24, 1, 2048, "GB"),
    )),
    _bigscience("02-25", 96, 12288, 64, 8, 1, 48, 1, 2048, 58),
    # 02-28, bf16 with fp32 gradient accumulation, 'type:transformer|embedding' ("Rebalancing layers")
    *(_bigscience("02-28", 106, 12288, a, 8, 4, 12, m, 2048, gb) for a, m, gb in
      ((64, 2, 67), (96, 2, 65), (128, 2, 67), (96, 4, 79))),
    *(_bigscience("02-28", 100, 12288, 64, *row) for row in
      ((16, 4, 6, 2, 2048, OOM), (16, 4, 6, 1, 2048, OOM), (8, 8, 6, 2, 2048, 61), (8, 8, 6, 4, 2048, 72))),
    *(_bigscience("02-28", 82, 13312, a, dp, tp, 12, m, 2048, gb) for a, dp, tp, m, gb in
      ((64, 4, 8, 4, 52), (64, 8, 4, 2, 63), (104, 8, 4, 2, 62), (128, 8, 4, 2, 60), (64, 8, 4, 4, 74))),
    _bigscience("02-28", 94, 13312, 128, 8, 4, 12, 2, 2048, 67),
    *(_bigscience("02-28", 70, 14336, a, dp, tp, 12, m, 2048, gb) for a, dp, tp, m, gb in
      ((64, 4, 8, 2, 40), (64, 8, 4, 2, 59), (112, 8, 4, 2, 59), (128, 8, 4, 2, 60), (64, 8, 4, 4, 73))),
    _bigscience("02-28", 82, 14336, 128, 8, 4, 12, 2, 2048, OOM),
)  # fmt: skip

MEGATRON_LM_525 = (
    "NVIDIA/Megatron-LM issue #525, https://github.com/NVIDIA/Megatron-LM/issues/525 (2023-09-29): its launch "
    "script and terminal log are in the reporter's fork, github.com/jindajia/Megatron-LM branch debug, "
    "debug/gpt2_755.sh and debug/terminal.txt (the argument dump and the out-of-memory line)"
)


def _megatron_lm_525() -> MemoryRun:
    """A GPT of 36 layers, hidden 1280, 20 heads, SwiGLU (ffn 3392, Megatron's 2/3 x 4h rounded down to a
    multiple of 64), seq 1024, micro batch 4, on one V100 ("31.74 GiB total capacity") with Megatron-LM's
    legacy model (transformer_impl local) of September 2023: every value from the log's argument dump.

    Published (the dump): tp = pp = dp = 1, fp16, --use-distributed-optimizer (nothing to shard with dp 1:
    fp32 main parameters and Adam's two moments, 12 bytes a parameter), accumulate_allreduce_grads_in_fp32
    False (an fp16 gradient buffer), no recomputation (recompute_granularity None), use_flash_attn False
    (the s x s scores materialized, fused scale-mask-softmax: our "unfused" backend), no sequence
    parallelism, learned absolute positions, LayerNorm, biases, dropout 0.1, tied embeddings, the GPT-2
    tokenizer's 50,257 tokens padded to 50,304. The log counts 771,201,024 parameters; so does our
    estimate of these flags. The outcome: out of memory in the first microbatch's forward, in the cross
    entropy's fp32 logits ("Tried to allocate 786.00 MiB", exactly 4 x 1024 x 50,304 x 4 bytes, with
    28.82 GiB allocated and 29.97 GiB reserved by PyTorch). Nothing is assumed."""
    flags = words(
        "--num-layers 36 --hidden-size 1280 --ffn-hidden-size 3392 --num-attention-heads 20 --swiglu "
        "--seq-length 1024 --max-position-embeddings 1024 --vocab-size 50257 --fp16 "
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --micro-batch-size 4 "
        "--global-batch-size 16 --use-distributed-optimizer --attention-backend unfused"
    )
    return MemoryRun(
        "Megatron-LM #525 GPT 771M V100 m4",
        MEGATRON_LM_525,
        1,
        31.74,
        tuple(flags),
        family="gpt",
        oom=True,
        grad_dtype=torch.float16,
    )


FUJII_SWEEP = (
    "Fujii, Watanabe, Yokota's 4D sweep of Llama-3.1-8B with Megatron-LM (arXiv 2411.06465, submitted to MLSys 2025), "
    "the table github.com/okoge-kaz/Megatron-LM scripts/abci/Llama-3.1-8B/4d_parallelism.md at "
    "e4e8c2184f64906e46442ce3ad2b64df9670d1ee (2024-10-22): TFLOP/s per (TP, CP, PP, micro batch) and GPU count "
    "on ABCI's A100 40 GB nodes (8 a node) and TSUBAME 4.0's H100 94 GB nodes (4 a node), '-' where it did not "
    "run; the flags of its job scripts scripts/abci/Llama-3.1-8B/llama-3.1-8b-tp4-pp2.sh at "
    "3ee8385be2baba8d889cef51a3bd65ebf638fb95 (outputs/Llama-3.1-8b-tflops) and "
    "scripts/tsubame/Llama-3.1-8B/llama-3.1-8B-tp2-pp2-te-v1.9.sh at d8add38421ce2bf4ab4eabf1ef9189ee142c961a "
    "(outputs/Llama-3.1-8b-MLSys25)"
)
# The table, one string a (TP, CP, PP, micro batch) row, one letter a GPU count column: R ran (a TFLOP/s
# figure), O did not ("-"; one cell reads the Japanese long-vowel mark, taken as "-"), . blank (not run)
_FUJII_TABLE = {
    ("a100-40gb", 8192, (8, 16, 32, 64, 128, 256)): (
        ((4, 1, 2, 1), "RRRRRR"), ((4, 1, 2, 2), "ORRRRR"), ((4, 1, 2, 4), "OOOOOO"),
        ((4, 2, 2, 1), ".RRRRR"), ((4, 2, 2, 2), ".RRRRR"), ((4, 2, 2, 4), "OOOOOO"),
        ((2, 2, 2, 1), "ORRRRR"), ((2, 2, 2, 2), "OOOOOO"),
        ((2, 4, 2, 1), ".RRRRR"), ((2, 4, 2, 2), ".ORRRR"),
        ((4, 2, 1, 1), "ORRRRR"), ((4, 2, 1, 2), "ORRRRR"), ((4, 2, 1, 4), "OOOOOO"),
        ((2, 2, 4, 1), ".RRRR."), ((2, 2, 4, 2), ".ORRR."),
        ((2, 4, 1, 1), "OORRRR"), ((2, 4, 1, 2), "OOOOOO"), ((2, 4, 1, 4), "OOOOOO"),
    ),
    ("h100-94gb", 8192, (4, 8, 16, 32, 64, 128)): (
        ((2, 1, 1, 1), "RRRRRR"), ((2, 1, 1, 2), "ORRRRR"), ((2, 1, 1, 4), "OOOOOO"),
        ((2, 2, 1, 1), "RRRRRR"), ((2, 2, 1, 2), "RRRRRR"), ((2, 2, 1, 4), "ORRRR."), ((2, 2, 1, 8), "OOOOO."),
        ((4, 1, 1, 1), "RRRRRR"), ((4, 1, 1, 2), "RRRRRR"), ((4, 1, 1, 4), "ORRRRR"),
        ((2, 1, 2, 1), "RRRRRR"), ((2, 1, 2, 2), "RRRRRR"), ((2, 1, 2, 4), "OOOOOO"),
        ((1, 2, 1, 1), "ORRR.."), ((1, 2, 1, 2), "OOOO.."),
        ((1, 4, 1, 1), "RRRR.."), ((1, 4, 1, 2), "ORRR.."),
    ),
    ("h100-94gb", 16384, (4, 8, 16, 32, 64, 128)): (
        ((2, 1, 1, 1), "ORRRR."), ((2, 1, 1, 2), "OOOOO."), ((2, 1, 1, 4), "OOOOOO"),
        ((2, 2, 1, 1), "RRRRR."), ((2, 2, 1, 2), "RRRRR."), ((2, 2, 1, 4), "OOOOO."), ((2, 2, 1, 8), "OOOOO."),
        ((4, 1, 1, 1), "RRRRR."), ((4, 1, 1, 2), "RRRRR."), ((4, 1, 1, 4), "OOOOO."),
        ((2, 1, 2, 1), "RRRRR."), ((2, 1, 2, 2), "OOOOR."), ((2, 1, 2, 4), "OOOOO."),
        ((1, 2, 1, 1), "OOOO.."), ((1, 2, 1, 2), "OOOO.."),
        ((1, 4, 1, 1), "ORRRR."), ((1, 4, 1, 2), "OOOOO."), ((1, 4, 1, 4), "OOOOO."),
        ((2, 4, 1, 1), ".RRR.."), ((2, 4, 1, 2), ".RRR.."), ((4, 2, 1, 1), ".RRR.."), ((4, 2, 1, 2), ".RRR.."),
    ),
}  # fmt: skip
# the device memory CUDA reports: A100 40 GB as hardware.py has it; TSUBAME 4.0's H100 SXM5 94 GB as the
# H100 NVL entry (the same 94 GB of HBM3)
_FUJII_DEVICES = {"a100-40gb": DEVICES["a100-40gb"].memory_gib, "h100-94gb": DEVICES["h100-nvl"].memory_gib}


def _fujii(device: str, seq: int, tp: int, cp: int, pp: int, mbs: int, gpus: int, oom: bool) -> MemoryRun:
    """One cell of the sweep's table. Published (the job scripts): Llama-3.1-8B's shape, bf16 with fp32
    gradient accumulation (--accumulate-allreduce-grads-in-fp32), sequence parallelism, the distributed
    optimizer with overlapped gradient reduction and parameter gather, TransformerEngine with flash
    attention, no recomputation, untied embeddings, global batch 1024, the Llama-3 tokenizer's 128,256
    tokens. Assumed: a '-' is an out-of-memory failure (the table does not say; every '-' cell is a layout
    that fits the GPU count, but one, which is left out, and the sweep's authors' paper is about exactly
    that outcome). Not counted: the dataloader's document mask of --reset-attention-mask ([b, 1, s/cp, s]
    bool on the device, 64-512 MiB; our flags refuse it with cp > 1) and Fujii's --use-z-loss (one fp32
    value a token)."""
    flags = words(
        "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 8 --vocab-size 128256 --bf16 --swiglu --normalization RMSNorm "
        "--disable-bias-linear --position-embedding-type rope --untie-embeddings-and-output-weights "
        "--accumulate-allreduce-grads-in-fp32 --sequence-parallel --use-distributed-optimizer "
        "--overlap-grad-reduce --overlap-param-gather --use-flash-attn --transformer-impl transformer_engine "
        f"--tensor-model-parallel-size {tp} --context-parallel-size {cp} --pipeline-model-parallel-size {pp} "
        f"--seq-length {seq} --micro-batch-size {mbs} --global-batch-size 1024"
    )
    name = f"Fujii {device} s{seq} tp{tp} cp{cp} pp{pp} m{mbs} n{gpus}"
    return MemoryRun(name, FUJII_SWEEP, gpus, _FUJII_DEVICES[device], tuple(flags), oom=oom)


FUJII_RUNS = tuple(
    _fujii(device, seq, *layout, gpus, outcome == "O")
    for (device, seq, columns), table in _FUJII_TABLE.items()
    for layout, outcomes in table
    for gpus, outcome in zip(columns, outcomes)
    # the A100 row (4, 2, 2, 4) reads '-' at 8 GPUs too, where tp x cp x pp = 16: not a layout
    if outcome != "." and layout[0] * layout[1] * layout[2] <= gpus
)

# Out-of-memory reports of Megatron-LM itself, given in full (this module's docstring
# lists the reports read and why the others could not be used)
MEGATRON_LM_RUNS = (_megatron_lm_525(),)

GPU_RESULTS = Path(__file__).resolve().parents[2] / "docs" / "gpu-results"


def own_runs(folder: Path = GPU_RESULTS) -> tuple[MemoryRun, ...]:
    """Our own trainer's outcomes near the device's limit: the memory_limit section of every GPU check report
    committed in `folder` (tools/gpu_check_lib/memory_limit.py; none yet: no GPU has run that section)."""
    from tools.gpu_check_lib.memory_limit import report_memory_runs

    return tuple(MemoryRun(**fields) for path in sorted(folder.glob("*.json")) for fields in report_memory_runs(path))


MEMORY_RUNS = (
    _llama31_8b(16384, 1),
    _llama31_8b(8192, 2),
    *BIGSCIENCE_RUNS,
    *MEGATRON_LM_RUNS,
    *FUJII_RUNS,
    *own_runs(),
)
