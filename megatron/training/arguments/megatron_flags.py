"""Megatron-LM flags that are not features here: accepted with a note, or refused by name.

Every flag of Megatron-LM's `arguments.py` is supported (the flag-group modules beside this one), a
no-op or refused, never "unrecognized" (tests/data/megatron_flags.txt is the list). The line
between the two kinds here: a flag whose absence changes only speed, logging detail or how
Megatron's own code is organised is accepted and listed at start-up, never silently; a flag
whose absence would change the result (the model's math, the data, the update, what is saved
or evaluated) or whether the job fits (memory savings) is refused. Refusals happen before
parsing, every offending flag in one message, so a script is fixed in one pass. Whole
families are matched by prefix (every --moe-* flag that moe.py does not build).
"""

from __future__ import annotations

import argparse
import re
from typing import NamedTuple

from megatron.training.arguments.fp8 import FP8_FLAGS
from megatron.training.arguments.moe import MOE_FIELDS


class NoOp(NamedTuple):
    """How argparse reads an accepted no-op flag (so its value is never taken for a flag) and why
    it changes nothing here."""

    nargs: int | str | None  # 0: a switch; None: one value; "+": one or more
    values: tuple[str, ...]  # the only values accepted (Megatron's default); empty: any value
    why: str


# why it changes nothing here -> its flags, written as usage: "--name" is a switch, "--name V" takes
# one value, "--name V..." one or more; "--name a|b" accepts only those values (Megatron's default,
# what runs here) and any other value is refused with the same reason.
_NO_OP = {
    "our GPTModel is the only model implementation": "--use-mcore-models --transformer-impl V",
    "the flash kernel is chosen by --attention-backend": "--use-flash-attn --flash-attention-version V",
    "there is no TransformerEngine or TorchScript here; the kernels are fixed": (
        "--fused-residual-rmsnorm --use-transformer-engine-op-fuser --use-te-activation-func --no-persist-layer-norm "
        "--disable-jit-fuser --use-grouped-gemm-for-dense-mlp"
    ),
    "gradients always accumulate into fp32 main_grad buffers": (
        "--accumulate-allreduce-grads-in-fp32 --ddp-param-name-patterns-for-fp32-local-accumulation V..."
    ),
    "gradients are reduced in fp32 here (more precise, twice the bytes)": (
        "--grad-reduce-in-bf16 --ddp-reduce-scatter-with-fp32-accumulation"
    ),
    "attention's softmax always accumulates in fp32 here": "--attention-softmax-in-fp32",
    "attention scores are fp32 in the flash and SDPA paths, where scaling them by 1/layer and back cancels "
    "(the unfused path, --attention-backend local, does not apply it)": "--apply-query-key-layer-scaling",
    "the loss is always the mean over the global batch's unmasked tokens": "--calculate-per-token-loss",
    "no mask is ever built: the kernels apply causality": "--no-create-attention-mask-in-dataloader",
    "the .bin files are always memory-mapped (numpy.memmap)": "--no-mmap-bin-files",
    "only used by --tokenizer-type TikTokenizer, which is not built here": (
        "--tiktoken-pattern V --tiktoken-num-special-tokens V"
    ),
    "training reads token ids: the tokenizer only gives the vocabulary size and the EOD id": (
        "--tokenizer-hf-no-use-fast --tokenizer-hf-no-include-special-tokens --use-gigatoken "
        "--no-tokenizer-sentencepiece-ignore-extra-whitespaces "
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces"
    ),
    "dataset-building speed options; the indices built are the same": (
        "--dataloader-fast-cache-load --dataloader-defer-npy-index-mmap --num-dataset-builder-threads V "
        "--per-dataset-sequences-path V"
    ),
    "object storage (MSC, s3://) is not read here": "--disable-msc --object-storage-cache-path V",
    "Python's garbage collector is left as it is": (
        "--manual-gc --manual-gc-interval V --no-manual-gc-eval --disable-manual-gc-eval"
    ),
    "the CUDA cache is not emptied between iterations": "--empty-unused-memory-level V",
    "no CUDA graphs here": (
        "--enable-cuda-graph --external-cuda-graph --cuda-graph-impl V --cuda-graph-warmup-steps V --cuda-graph-scope "
        "V... --cuda-graph-modules V... --optimizer-cuda-graph"
    ),
    "dropout draws from our own per-rank generator streams": "--te-rng-tracker",
    "TransformerEngine's userbuffer overlap of tensor-parallel communication is not used": (
        "--tp-comm-overlap --tp-comm-overlap-cfg V --tp-comm-bootstrap-backend V --tp-comm-overlap-rs-dgrad "
        "--no-tp-comm-bulk-wgrad --disable-tp-comm-bulk-wgrad --no-tp-comm-bulk-dgrad --disable-tp-comm-bulk-dgrad "
        "--no-tp-comm-overlap-ag --disable-tp-comm-overlap-ag --no-tp-comm-overlap-rs --disable-tp-comm-overlap-rs "
        "--no-tp-comm-split-ag --disable-tp-comm-split-ag --no-tp-comm-split-rs --disable-tp-comm-split-rs"
    ),
    "pipeline sends and weight-gradient timing follow our own schedule": (
        "--delay-wgrad-compute --defer-embedding-wgrad-compute --wgrad-deferral-limit V "
        "--overlap-p2p-communication-warmup-flush --no-overlap-p2p-communication --use-ring-exchange-p2p "
        "--pipeline-model-parallel-comm-backend V"
    ),
    "collective tuning (buckets, NCCL options, streams, alignment, host syncs) that leaves the result unchanged": (
        "--no-align-grad-reduce --disable-align-grad-reduce --no-align-param-gather "
        "--overlap-param-gather-with-optimizer-step --ddp-pad-buckets-for-high-nccl-busbw --ddp-average-in-collective "
        "--create-all-gather-group --use-nccl-ub --disable-symmetric-registration --use-sharp --sharp-enabled-group V "
        "--high-priority-stream-groups V... --nccl-communicator-config-path V --disable-gloo-process-groups "
        "--train-sync-interval V"
    ),
    "gradient buckets are sized by --ddp-bucket-size": "--ddp-num-buckets V",
    "one distributed-optimizer instance spans the data-parallel group (Megatron's default)": (
        "--num-distributed-optimizer-instances 1"
    ),
    "ranks come from torchrun's environment": "--local-rank V",
    "one process-group timeout here: --distributed-timeout-minutes": "--distributed-timeout-seconds-after-init V",
    "NCCL's flight recorder is left to the TORCH_NCCL_* environment variables": (
        "--flight-recorder-dump-path V --flight-recorder-trace-buffer-size V --no-flight-recorder-dump-on-timeout "
        "--disable-flight-recorder-dump-on-timeout --flight-recorder-include-stack-trace "
        "--no-flight-recorder-include-only-active --disable-flight-recorder-include-only-active "
        "--no-flight-recorder-extra-dump-on-exec --disable-flight-recorder-extra-dump-on-exec"
    ),
    "initial values are the same on any device and parallel layout here": (
        "--use-cpu-initialization --init-model-with-meta-device"
    ),
    "parameters are always initialised (--load then overwrites them)": "--no-initialization",
    "an implementation detail of Megatron's code with no counterpart here": (
        "--no-clone-scatter-output-in-embedding --disable-clone-scatter-output-in-embedding --enable-experimental "
        "--onnx-safe V"
    ),
    "no per-phase timers; the log line has the iteration time": (
        "--timing-log-level V --timing-log-option V --no-barrier-with-level-1-timing"
    ),
    "the log line always shows throughput": "--log-throughput",
    "a logging or debug output not written here": (
        "--log-progress --tensorboard-log-interval V --tensorboard-queue-size V --no-log-loss-scale-to-tensorboard "
        "--disable-log-loss-scale-to-tensorboard --log-memory-interval V --log-device-memory-used "
        "--log-max-attention-logit --logging-level V --log-energy --config-logger-dir V --wandb-entity V "
        "--result-rejected-tracker-filename V --dump-param-to-param-group-map V"
    ),
    "no telemetry (OpenTelemetry, one-logger) here": (
        "--otel-enabled --otel-service-name V --otel-span-groups V --no-one-logger --one-logger-project V "
        "--one-logger-run-name V --one-logger-async --app-tag-run-name V --app-tag-run-version V"
    ),
    "--profile always writes a torch.profiler trace": "--use-pytorch-profiler",
    "a profiler option not implemented here (--profile writes a torch.profiler trace)": (
        "--pytorch-profiler-collect-shapes --pytorch-profiler-collect-callstack --pytorch-profiler-collect-chakra "
        "--record-shapes --nvtx-ranges --record-memory-history --memory-snapshot-path V"
    ),
    "no health checks or re-run engine here (results are not re-validated)": (
        "--rerun-mode V --check-for-large-grads --check-for-spiky-loss --no-check-for-nan-in-loss-and-grad "
        "--check-weight-hash-across-dp-replicas-interval V --gpu-sniff-test-interval V"
    ),
    "--exit-signal-handler catches SIGTERM only": "--exit-signal SIGTERM",
    "signals end the run as Python's defaults do; --exit-signal-handler saves first": (
        "--exit-signal-handler-for-training --exit-signal-handler-for-dataloader"
    ),
    "the global batch size never changes: one that does not divide stops with one line": (
        "--decrease-batch-size-if-needed"
    ),
    "the learning-rate schedule always comes from the command line": (
        "--override-opt-param-scheduler --override-opt_param-scheduler"
    ),
    "how torch_dist files are written and read: ours have one layout, loadable into any parallel layout": (
        "--use-dist-ckpt --dist-ckpt-format torch_dist --auto-detect-ckpt-format --ckpt-fully-parallel-save "
        "--no-ckpt-fully-parallel-save --ckpt-fully-parallel-load --ckpt-fully-parallel-load-exchange-algo V "
        "--ckpt-fully-parallel-load-per-rank-objects --ckpt-fully-parallel-save-process-group V "
        "--ckpt-fully-parallel-load-process-group V --ckpt-assume-constant-structure --ckpt-pg-tensors-cache-path V "
        "--ckpt-pg-tensors-cache-create --no-ckpt-load-validate-sharding-integrity "
        "--disable-ckpt-load-validate-sharding-integrity --dist-ckpt-strictness V --dist-ckpt-workers V "
        "--dist-ckpt-save-pre-mcore-014 --dist-ckpt-optim-fully-reshardable "
        "--distrib-optim-fully-reshardable-mem-efficient --ckpt-drop-redundant-extra-state"
    ),
    "--async-save here writes from one background thread per rank, staged in host memory": (
        "--async-strategy V --use-persistent-ckpt-worker --async-ckpt-cpu-priority V --async-ckpt-io-priority V "
        "--async-ckpt-use-cpu-shm"
    ),
    "checkpoints always hold the optimizer and RNG states": "--no-save-optim --no-save-rng",
    "checkpoints hold no tokenizer files or arguments here": (
        "--no-save-tokenizer-assets --disable-save-tokenizer-assets --no-use-tokenizer-model-from-checkpoint-args "
        "--disable-use-tokenizer-model-from-checkpoint-args"
    ),
    "the offloaded step is always torch's fused CPU AdamW, overlapped, on pinned host buffers": (
        "--use-torch-optimizer-for-cpu-offload --overlap-cpu-optimizer-d2h-h2d --no-pin-cpu-grads --no-pin-cpu-params"
    ),
    "Adam with decoupled weight decay is the only optimizer here": "--optimizer adam",
    "samples are read once, in the dataset's shuffled order (Megatron's single loader)": "--dataloader-type single",
    "the rotary embedding is plain RoPE (YaRN is not built)": "--rope-type rope",
    "attention uses the standard softmax": "--softmax-type vanilla",
    "weight decay is constant (--weight-decay)": "--weight-decay-incr-style constant",
    "selective recompute recomputes core attention": "--recompute-modules core_attn...",
}
FUSION_TOGGLE = re.compile(r"^--no-[a-z0-9-]+-fusion$")  # --no-masked-softmax-fusion, --no-rope-fusion, ...
BUILT_FUSION_SWITCHES = (
    "--no-gradient-accumulation-fusion",
    "--no-rope-fusion",
    "--no-bias-swiglu-fusion",
)  # real flags of the parser (model.py)
# flags of a refused prefix that the parser supports (moe.py, fp8.py)
BUILT_PREFIXED = frozenset(MOE_FIELDS.values()) | frozenset(FP8_FLAGS)
NO_OP_GROUP = "Megatron flags with no effect here"

# family -> (reason, exact flags, prefixes); the first family that matches a flag names it
REFUSED = {
    "MoE": (
        "an MoE option not built here (the built ones are supported, in the table above)",
        (
            "--expert-tensor-parallel-num-weight-shards",
            "--overlap-moe-expert-parallel-comm",
            "--overlap-dispatch-backward-with-experts-wgrad",
            "--ep-overlap-early-attn-memory-release",
            "--use-fused-weighted-squared-relu",
            "--high-priority-a2a-comm-stream",
            "--use-grouped-gemm-for-shared-expert",
            "--save-tokens-per-expert-interval",
        ),
        ("--moe-",),
    ),
    "MLA": (
        "multi-latent attention is out of scope",
        (
            "--multi-latent-attention",
            "--q-lora-rank",
            "--kv-lora-rank",
            "--qk-head-dim",
            "--qk-pos-emb-head-dim",
            "--v-head-dim",
            "--rotary-scaling-factor",
            "--mscale",
            "--mscale-all-dim",
            "--cache-mla-latents",
        ),
        ("--mla-",),
    ),
    "FP8/FP4": (
        "FP4, MXFP8 and the FP8 options beyond the built recipes (docs/fp8.md) are not built",
        (
            "--reuse-grad-buf-for-mxfp8-param-ag",
            "--keep-fp8-transpose-cache",
            "--te-precision-config-file",
            "--use-kitchen-attention",
            "--kitchen-attention-backend",
            "--kitchen-config-file",
            "--kitchen-recipe-number",
        ),
        ("--fp8", "--fp4"),
    ),
    "FSDP": (
        "other FSDP implementations are out of scope; use --use-megatron-fsdp --data-parallel-sharding-strategy",
        (
            "--use-torch-fsdp2",
            "--use-custom-fsdp",
            "--outer-dp-sharding-strategy",
            "--suggested-communication-unit-size",
            "--enable-full-sharding-in-hsdp",
            "--torch-fsdp2-no-reshard-after-forward",
            "--no-strict-fsdp-dtensor-load",
            "--disable-strict-fsdp-dtensor-load",
            "--no-use-layer-wise-param-layout",
        ),
        ("--fsdp-", "--megatron-fsdp-"),
    ),
    "multimodal": (
        "multimodal and vision models are out of scope",
        (
            "--img-h",
            "--img-w",
            "--patch-dim",
            "--num-channels",
            "--mrope-section",
            "--num-classes",
            "--classes-fraction",
            "--data-per-class-fraction",
            "--no-data-sharding",
            "--head-lr-mult",
            "--mask-type",
            "--mask-factor",
            "--iter-per-epoch",
        ),
        ("--vision-", "--dino-", "--swin-"),
    ),
    "multi-token prediction": ("multi-token prediction is out of scope", (), ("--mtp-",)),
    "parallelism and memory savings": (
        "a parallel layout or memory saving not built here (the memory estimate would not hold)",
        (
            "--tensor-parallel-num-weight-shards",
            "--hierarchical-context-parallel-sizes",
            "--max-seqlen-per-dp-cp-rank",
            "--hybrid-context-parallel",
            "--account-for-embedding-in-pipeline-split",
            "--account-for-loss-in-pipeline-split",
            "--pipeline-model-parallel-layout",
            "--cpu-offloading-num-layers",
            "--cpu-offloading-retain-pinned-cpu-buffers",
            "--fine-grained-activation-offloading",
            "--offload-modules",
            "--min-offloaded-tensor-size",
            "--delay-offload-until-cuda-graph",
            "--delta-offload-bytes-across-pp-ranks",
            "--activation-offload-fraction",
            "--fine-grained-offloading-max-inflight-offloads",
            "--distribute-saved-activations",
            "--mlp-chunks-for-training",
            "--lazy-mpu-init",
            "--fake-process-group",
        ),
        ("--gtp-",),
    ),
    "hybrid and heterogeneous models": (
        "Mamba, linear-attention, DSA, mHC and heterogeneous-layer models are out of scope",
        (
            "--is-hybrid-model",
            "--experimental-attention-variant",
            "--disable-mamba-mem-eff-path",
            "--enable-mhc-connections",
        ),
        (
            "--hybrid-",
            "--mamba-",
            "--linear-",
            "--dsa-",
            "--no-dsa-",
            "--disable-dsa-",
            "--gdp-",
            "--mhc-",
            "--heterogeneous-",
        ),
    ),
    "model variants": (
        "changes the model's math in a way not built here",
        (
            "--embedding-init-method-std",
            "--data-parallel-random-init",
            "--fp32-residual-connection",
            "--apply-residual-connection-post-layernorm",
            "--glu-linear-offset",
            "--activation-func-clamp-value",
            "--openai-gelu",
            "--squared-relu",
            "--quick-geglu",
            "--qk-l2-norm",
            "--qk-clip",
            "--qk-clip-alpha",
            "--qk-clip-threshold",
            "--attention-output-gate",
            "--window-size",
            "--window-attn-skip-freq",
            "--rotary-seq-len-interpolation-factor",
            "--no-rope-freq",
            "--use-mup",
            "--fp16-lm-cross-entropy",
            "--output-logit-dtype",
            "--disable-bf16-reduced-precision-matmul",
            "--batch-invariant-mode",
            "--batch-invariant-backend",
            "--spec",
        ),
        ("--mup-", "--yarn-", "--no-yarn-"),
    ),
    "optimizer variants": (
        "only AdamW with fp32 master weights and moments, constant weight decay and the command line's schedule "
        "is built",
        (
            "--sgd-momentum",
            "--use-precision-aware-optimizer",
            "--main-grads-dtype",
            "--main-params-dtype",
            "--exp-avg-dtype",
            "--exp-avg-sq-dtype",
            "--start-weight-decay",
            "--end-weight-decay",
            "--apply-wd-to-qk-layernorm",
            "--no-weight-decay-cond-type",
            "--freeze-all-layers",
            "--use-checkpoint-opt-param-scheduler",
            "--use-checkpoint-opt_param-scheduler",
            "--load-main-params-from-ckpt",
        ),
        ("--muon-", "--lion-"),
    ),
    "data variants": (
        "changes which tokens or samples are trained on in a way not built here",
        (
            "--dataloader-inter-document-masking",
            "--iterations-to-skip",
            "--phase-transition-iterations",
            "--data-args-path",
            "--per-split-data-args-path",
            "--mid-level-dataset-surplus",
            "--allow-ambiguous-pad-tokens",
            "--padded-vocab-size",
            "--no-pad-vocab-size",
            "--disable-pad-vocab-size",
            "--null-tokenizer-eod-id",
            "--null-tokenizer-pad-id",
            "--tokenizer-sentencepiece-legacy",
            "--tokenizer-special-tokens",
            "--tokenizer-metadata",
            "--trust-remote-code",
        ),
        ("--fim-",),
    ),
    "checkpoint and evaluation variants": (
        "changes what is saved, loaded or evaluated in a way not built here",
        (
            "--persistent-save-interval",
            "--save-params-interval",
            "--save-activations-interval",
            "--save-wgrads-interval",
            "--save-dgrads-interval",
            "--save-retain-interval",
            "--pretrained-checkpoint",
            "--ckpt-step",
            "--use-checkpoint-args",
            "--use-mp-args-from-checkpoint-args",
            "--exit-on-missing-checkpoint",
            "--ckpt-convert-format",
            "--ckpt-convert-save",
            "--ckpt-convert-update-legacy-dist-opt-format",
            "--verify-integrity",
            "--override-ckpt-iteration",
            "--start-eval-at-iter",
            "--eval-global-batch-size",
            "--eval-micro-batch-size",
            "--full-validation",
            "--multiple-validation-sets",
            "--validation-set-names",
            "--test-mode",
            "--yaml-cfg",
            "--enable-msc",
        ),
        ("--non-persistent-",),
    ),
    "BERT, T5 and retrieval": (
        "encoder and retrieval models are out of scope (GPT-style decoders only)",
        (
            "--encoder-num-layers",
            "--decoder-num-layers",
            "--encoder-seq-length",
            "--decoder-seq-length",
            "--relative-attention-num-buckets",
            "--relative-attention-max-distance",
            "--vocab-extra-ids",
            "--sample-rate",
            "--mask-prob",
            "--short-seq-prob",
            "--output-bert-embeddings",
            "--titles-data-path",
            "--query-in-block-prob",
            "--use-one-sent-docs",
            "--evidence-data-path",
            "--block-data-path",
            "--embedding-path",
        ),
        ("--bert-", "--ict-", "--biencoder-", "--retriever-", "--indexer-", "--retro-"),
    ),
    "inference": (
        "inference is out of scope (training only)",
        (
            "--flash-decode",
            "--decode-only-cuda-graphs",
            "--enable-chunked-prefill",
            "--num-speculative-tokens",
            "--max-tokens-to-oom",
            "--use-legacy-static-engine",
            "--mlp-chunks-for-prefill",
            "--nccl-all-reduce-for-prefill",
            "--symmetric-ar-type",
            "--use-same-sampling-seed-across-dp-ranks",
        ),
        ("--inference-", "--no-inference-"),
    ),
    "post-training": (
        "RL, SFT and distillation are out of scope (pre-training only)",
        (
            "--perform-rl-step",
            "--langrl-env-config",
            "--refit-method",
            "--sft",
            "--sft-tokenizer-prompt-format",
            "--chat-template",
        ),
        ("--rl-", "--no-rl-", "--grpo-", "--logits-"),
    ),
    "resiliency": (
        "fault tolerance, in-process restart, straggler detection and NVRx are out of scope",
        (
            "--enable-ft-package",
            "--calc-ft-timeouts",
            "--ft-num-warmup-iters",
            "--replication",
            "--replication-jump",
            "--replication-factor",
            "--log-straggler",
            "--disable-straggler-on-startup",
            "--run-workload-inspector-server",
            "--adlr-autoresume",
            "--adlr-autoresume-interval",
        ),
        ("--inprocess-", "--fault-injector-", "--straggler-", "--error-injection-"),
    ),
    "removed from Megatron-LM": (
        "Megatron-LM itself rejects these; use --micro-batch-size, --lr-warmup-*, --tensor-model-parallel-size, "
        "--recompute-activations",
        ("--batch-size", "--warmup", "--model-parallel-size", "--checkpoint-activations"),
        (),
    ),
}


def _parse_usage(usage: str, why: str) -> dict[str, NoOp]:
    """'--a --b V --c x|y...' -> {flag: NoOp} (see _NO_OP)."""
    flags: dict[str, NoOp] = {}
    for token in usage.split():
        if token.startswith("--"):
            flag = token
            flags[flag] = NoOp(0, (), why)
            continue
        word = token.removesuffix("...")
        flags[flag] = NoOp("+" if token.endswith("...") else None, () if word == "V" else tuple(word.split("|")), why)
    return flags


NO_OP_FLAGS = {flag: spec for why, usage in _NO_OP.items() for flag, spec in _parse_usage(usage, why).items()}


def _family(flag: str) -> str | None:
    if flag in BUILT_PREFIXED:
        return None
    for family, (_, exact, prefixes) in REFUSED.items():
        if flag in exact or flag.startswith(prefixes):
            return family
    return None


def classify(flag: str) -> tuple[str, str] | None:
    """(kind, reason) of a flag this module knows: ("no-op", why) or ("refused", "family: reason");
    None for the parser's supported flags and unknown ones."""
    if flag in NO_OP_FLAGS:
        return "no-op", NO_OP_FLAGS[flag].why
    if _is_fusion_toggle(flag):
        return "no-op", "fusions are not optional switches"
    family = _family(flag)
    return ("refused", f"{family}: {REFUSED[family][0]}") if family else None


def _is_fusion_toggle(flag: str) -> bool:
    return bool(FUSION_TOGGLE.match(flag)) and flag not in BUILT_FUSION_SWITCHES


def _values(argv: list[str], i: int, spec: NoOp) -> list[str]:
    """The values given to the no-op flag at argv[i]."""
    if "=" in argv[i]:
        return [argv[i].split("=", 1)[1]]
    rest = argv[i + 1 :]
    if spec.nargs is None:
        return rest[:1]
    return rest[: next((k for k, token in enumerate(rest) if token.startswith("--")), len(rest))]


def refuse_out_of_scope(argv: list[str]) -> None:
    """Raise one ValueError line naming every refused flag in argv (grouped by family) and every
    no-op flag given a value other than the one that runs here."""
    found: dict[str, list[str]] = {}
    wrong_values: list[str] = []
    for i, token in enumerate(argv):
        flag = token.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        family = _family(flag)
        if family and flag not in found.setdefault(family, []):
            found[family].append(flag)
        spec = NO_OP_FLAGS.get(flag)
        if spec and spec.values:
            bad = [v for v in _values(argv, i, spec) if v not in spec.values]
            if bad:
                wrong_values.append(f"{flag} {' '.join(bad)} ({spec.why})")
    parts = [f"{family} ({REFUSED[family][0]}): {' '.join(flags)}" for family, flags in found.items() if flags]
    if parts or wrong_values:
        raise ValueError(f"not supported here, remove these flags: {'; '.join(parts + wrong_values)}")


def strip_fusion_toggles(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without Megatron's --no-*-fusion switches, the switches found)."""
    toggles = [t for t in argv if _is_fusion_toggle(t) and t not in NO_OP_FLAGS]
    return [t for t in argv if t not in toggles], toggles


def add_no_op_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Each no-op flag is its own destination (the flag itself), so aliases and look-alikes of
    supported flags never share one."""
    g = parser.add_argument_group(
        NO_OP_GROUP, "accepted; they change nothing here (noted at start-up), as does every --no-*-fusion switch"
    )
    for flag, spec in NO_OP_FLAGS.items():
        if spec.nargs == 0:
            g.add_argument(flag, dest=flag, action="store_true", default=None, help=f"no effect: {spec.why}")
        else:
            g.add_argument(
                flag, dest=flag, nargs=spec.nargs, metavar="|".join(spec.values) or "V", help=f"no effect: {spec.why}"
            )
    return parser


def no_op_notes(args, fusion_toggles: list[str]) -> list[str]:
    """One start-up line per accepted no-op flag that was given."""
    notes = []
    for flag, spec in NO_OP_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            shown = f"{flag} {' '.join(value) if isinstance(value, list) else value}" if spec.values else flag
            notes.append(f"> note: {shown} changes nothing here: {spec.why}")
    if fusion_toggles:
        notes.append(f"> note: {' '.join(fusion_toggles)} change nothing here: fusions are not optional switches")
    return notes


def _code(flags) -> str:
    return " ".join(f"`{f}`" for f in flags)


def compatibility_table(parser: argparse.ArgumentParser) -> str:
    """The README's Megatron flag table: supported flags from the parser's groups, then the no-op
    and refused tables above, so it cannot drift."""
    rows = ["| status | what | flags |", "| --- | --- | --- |"]
    for group in parser._action_groups:
        flags = [o for a in group._group_actions if a.dest != "help" for o in a.option_strings]
        if flags and group.title != NO_OP_GROUP:
            rows.append(f"| supported | {group.title} | {_code(flags)} |")
    for why, usage in _NO_OP.items():
        shown = [
            f"{flag} {'|'.join(spec.values)}" if spec.values else flag
            for flag, spec in _parse_usage(usage, why).items()
        ]
        rows.append(f"| no effect (noted) | {why} | {_code(shown)} |")
    rows.append("| no effect (noted) | fusions are not optional switches | `--no-*-fusion` |")
    for family, (reason, exact, prefixes) in REFUSED.items():
        rows.append(f"| refused | {family}: {reason} | {_code(list(exact) + [f'{p}*' for p in prefixes])} |")
    return "\n".join(rows)
