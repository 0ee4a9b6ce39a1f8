"""Megatron-LM flags that are not features here: accepted with a note, or refused by name.

Launch scripts carry Megatron's implementation toggles (fusions, TransformerEngine, garbage
collection, timers); they have no meaning for this code, so they are accepted and listed at
start-up, never silently. Features out of scope (MoE, MLA, FP8/FP4, FSDP, multimodal,
multi-token prediction) are refused before parsing, every offending flag in one message, so a
script is fixed in one pass. Whole families are matched by prefix (every --moe-* flag).
"""
from __future__ import annotations

import argparse
import re

# flag -> (takes a value, why it changes nothing here)
NO_OP_FLAGS = {
    "--use-mcore-models": (False, "our GPTModel is the only model implementation"),
    "--transformer-impl": (True, "one implementation here: PyTorch with our Triton kernels"),
    "--use-flash-attn": (False, "the flash kernel is chosen by --attention-backend"),
    "--no-gradient-accumulation-fusion": (False, "gradients always accumulate into fp32 main_grad buffers"),
    "--manual-gc": (False, "Python's garbage collector is left as it is"),
    "--manual-gc-interval": (True, "Python's garbage collector is left as it is"),
    "--no-manual-gc-eval": (False, "Python's garbage collector is left as it is"),
    "--empty-unused-memory-level": (True, "the CUDA cache is not emptied between iterations"),
    "--timing-log-level": (True, "no per-phase timers; the log line has the iteration time"),
    "--timing-log-option": (True, "no per-phase timers; the log line has the iteration time"),
    "--log-throughput": (False, "the log line always shows throughput"),
    "--attention-softmax-in-fp32": (False, "attention's softmax always accumulates in fp32 here"),
    "--cross-entropy-loss-fusion": (False, "the vocab-parallel cross-entropy is already one pass over the logits"),
    "--cross-entropy-fusion-impl": (True, "the vocab-parallel cross-entropy is already one pass over the logits"),
    "--grad-reduce-in-bf16": (False, "gradients are reduced in fp32 here (more precise, twice the bytes)"),
    "--no-create-attention-mask-in-dataloader": (False, "no mask is ever built: the kernels apply causality"),
    "--calculate-per-token-loss": (False, "the loss is always the mean over the global batch's unmasked tokens"),
    "--no-mmap-bin-files": (False, "the .bin files are always memory-mapped (numpy.memmap)"),
    "--tiktoken-pattern": (True, "only used by --tokenizer-type TikTokenizer, which is not built here"),
}
FUSION_TOGGLE = re.compile(r"^--no-[a-z0-9-]+-fusion$")  # --no-masked-softmax-fusion, --no-rope-fusion, ...

# family -> (reason, exact flags, prefixes)
REFUSED = {
    "MoE": ("mixture of experts is out of scope",
            ("--num-experts", "--expert-model-parallel-size", "--expert-tensor-parallel-size"), ("--moe-",)),
    "MLA": ("multi-latent attention is out of scope",
            ("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
             "--v-head-dim"), ("--mla-",)),
    "FP8/FP4": ("FP8/FP4 training is out of scope until a GPU issue; use --bf16", (), ("--fp8", "--fp4")),
    "FSDP": ("FSDP is out of scope; use --use-distributed-optimizer",
             ("--use-torch-fsdp2", "--use-megatron-fsdp", "--use-custom-fsdp", "--data-parallel-sharding-strategy"),
             ("--fsdp-",)),
    "multimodal": ("multimodal models are out of scope", ("--img-h", "--img-w", "--patch-dim", "--num-channels"),
                   ("--vision-",)),
    "multi-token prediction": ("multi-token prediction is out of scope", (), ("--mtp-",)),
    "not built": ("not built yet",
                  ("--use-tp-pp-dp-mapping", "--init-method-xavier-uniform"), ()),
}


def _family(flag: str) -> str | None:
    for family, (_, exact, prefixes) in REFUSED.items():
        if flag in exact or flag.startswith(prefixes):
            return family
    return None


def refuse_out_of_scope(argv: list[str]) -> None:
    """Raise one ValueError line naming every out-of-scope flag in argv, grouped by family."""
    found: dict[str, list[str]] = {}
    for token in argv:
        flag = token.split("=", 1)[0]
        family = _family(flag) if flag.startswith("--") else None
        if family and flag not in found.setdefault(family, []):
            found[family].append(flag)
    found = {family: flags for family, flags in found.items() if flags}
    if found:
        parts = [f"{family} ({REFUSED[family][0]}): {' '.join(flags)}" for family, flags in found.items()]
        raise ValueError(f"not supported here, remove these flags: {'; '.join(parts)}")


def strip_fusion_toggles(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without Megatron's --no-*-fusion switches, the switches found)."""
    toggles = [t for t in argv if FUSION_TOGGLE.match(t) and t not in NO_OP_FLAGS]
    return [t for t in argv if t not in toggles], toggles


def add_no_op_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("Megatron implementation toggles", "accepted; they change nothing here (noted at "
                                  "start-up), as does every --no-*-fusion switch")
    for flag, (takes_value, why) in NO_OP_FLAGS.items():
        if takes_value:
            g.add_argument(flag, metavar="VALUE", help=f"no effect: {why}")
        else:
            g.add_argument(flag, action="store_true", default=None, help=f"no effect: {why}")
    return parser


def no_op_notes(args, fusion_toggles: list[str]) -> list[str]:
    """One start-up line per accepted no-op flag that was given."""
    given = [flag for flag in NO_OP_FLAGS if getattr(args, flag[2:].replace("-", "_")) is not None]
    notes = [f"> note: {flag} changes nothing here: {NO_OP_FLAGS[flag][1]}" for flag in given]
    if fusion_toggles:
        notes.append(f"> note: {' '.join(fusion_toggles)} change nothing here: fusions are not optional switches")
    return notes


def compatibility_table(parser: argparse.ArgumentParser) -> str:
    """The README's Megatron flag table, generated from the parser so it cannot drift."""
    rows = ["| group | status | flags |", "| --- | --- | --- |"]
    for group in parser._action_groups:
        flags = [a.option_strings[0] for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not flags:
            continue
        status = "accepted, no effect (noted)" if group.title == "Megatron implementation toggles" else "supported"
        extra = " `--no-*-fusion`" if status != "supported" else ""
        rows.append(f"| {group.title} | {status} | {' '.join(f'`{f}`' for f in flags)}{extra} |")
    for family, (reason, exact, prefixes) in REFUSED.items():
        flags = [f"`{f}`" for f in exact] + [f"`{p}*`" for p in prefixes]
        rows.append(f"| {family} | refused: {reason} | {' '.join(flags)} |")
    return "\n".join(rows)
