"""The model-field record stays complete and true to the command line.

Every TransformerConfig field is either a model field (recorded in checkpoints, compared on
resume, represented or refused by the Hugging Face export) or declared as runtime-only; and
each recorded flag, given on the command line, sets the config field the record names.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.model_fields import MODEL_FIELDS, RUNTIME_FIELDS
from megatron.training.arguments.parser import GPT_DEFAULTS, parse_run_config
from megatron.training.checkpoint.torch_dist_args import args_mismatch, config_fields, megatron_args
from tests.cli import ROOT

BASE = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "1",
    "--train-iters",
    "1",
    "--mock-data",
    "--vocab-size",
    "100",
]
# a value other than the default for each flag that takes one
VALUES = {
    "--num-layers": "3",
    "--hidden-size": "128",
    "--ffn-hidden-size": "96",
    "--num-attention-heads": "8",
    "--num-query-groups": "2",
    "--kv-channels": "32",
    "--vocab-size": "50",
    "--position-embedding-type": "rope",
    "--max-position-embeddings": "32",
    "--normalization": "RMSNorm",
    "--norm-epsilon": "1e-06",
    "--rotary-percent": "0.5",
    "--rotary-base": "500000",
    "--rope-scaling-factor": "4",
    "--seq-length": "32",
    "--init-method-std": "0.01",
    "--num-experts": "8",
    "--moe-ffn-hidden-size": "96",
    "--moe-layer-freq": "[1, 0]",
    "--moe-shared-expert-intermediate-size": "64",
    "--moe-router-topk": "3",
    "--moe-router-score-function": "sigmoid",
    "--moe-router-topk-scaling-factor": "2.5",
    "--moe-router-num-groups": "2",
    "--moe-router-group-topk": "1",
    "--moe-expert-capacity-factor": "1.5",
    "--moe-token-drop-policy": "position",
}
# what a flag needs beside it (MoE fields need a model with experts, and some of them each other)
MOE = ["--num-experts", "4", "--disable-bias-linear"]
NEEDS = {
    "--moe-shared-expert-gate": ["--moe-shared-expert-intermediate-size", "64"],
    "--moe-router-enable-expert-bias": ["--moe-router-score-function", "sigmoid"],
    "--moe-router-num-groups": ["--moe-router-group-topk", "1"],
    "--moe-router-group-topk": ["--moe-router-num-groups", "2"],
    "--moe-token-drop-policy": ["--moe-expert-capacity-factor", "1.5"],
}


def test_every_config_field_is_classified_once():
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    recorded = [field.name for field in MODEL_FIELDS]
    assert len(recorded) == len(set(recorded))
    assert not set(recorded) & RUNTIME_FIELDS
    assert names == set(recorded) | RUNTIME_FIELDS, names ^ (set(recorded) | RUNTIME_FIELDS)


@pytest.mark.parametrize("field", MODEL_FIELDS, ids=[f.flag for f in MODEL_FIELDS])
def test_each_recorded_flag_sets_its_field(field):
    flags = list(BASE)
    if field.flag in flags:  # replace the base value
        at = flags.index(field.flag)
        del flags[at : at + 2]
    extra = [field.flag] if field.flag not in VALUES else [field.flag, VALUES[field.flag]]
    if field.flag == "--num-query-groups":
        extra.insert(0, "--group-query-attention")
    if field.flag == "--rope-scaling-factor":
        extra.append("--rope-scaling")
    base = list(BASE)
    if field.name.startswith("moe_"):
        base += MOE
        flags += MOE + NEEDS.get(field.flag, [])
    elif field.flag == "--num-experts":
        extra.append("--disable-bias-linear")
    config = parse_run_config(flags + extra, GPT_DEFAULTS, 1).model
    default = parse_run_config(base, GPT_DEFAULTS, 1).model
    assert getattr(config, field.name) != getattr(default, field.name), field
    assert field.command_line(getattr(config, field.name))[0] == field.flag


MEGATRON_FLAGS = {
    line.split()[0]
    for line in (ROOT / "tests" / "data" / "megatron_flags.txt").read_text().splitlines()
    if line.startswith("--")
}


@pytest.mark.parametrize("field", MODEL_FIELDS, ids=[f.flag for f in MODEL_FIELDS])
def test_each_field_has_megatron_lms_argument(field):
    """The name a Megatron-LM checkpoint records the field under is one of Megatron-LM's flags
    (--disable-bias-linear stores add_bias_linear)."""
    flag = (
        "--disable-bias-linear"
        if field.megatron_arg == "add_bias_linear"
        else "--" + field.megatron_arg.replace("_", "-")
    )
    assert flag in MEGATRON_FLAGS, (field, flag)


def test_megatron_args_round_trip_and_every_checked_field_is_compared():
    config = parse_run_config(
        BASE + ["--position-embedding-type", "rope", "--rope-scaling", "--rope-scaling-factor", "4"], GPT_DEFAULTS, 1
    ).model
    args = megatron_args(config, iteration=1, consumed_samples=0, tp=1, pp=1, extra={})
    assert args_mismatch(args, config) is None
    assert TransformerConfig(**config_fields(args)).rope_scaling_factor == 4
    args.rope_scaling_factor = 8.0
    assert args_mismatch(args, config) == "saved with --rope-scaling-factor 8, the flags give 4"
    args.rope_scaling_factor, args.add_bias_linear = 4.0, False
    assert args_mismatch(args, config) == "saved with --disable-bias-linear, the flags leave it out"


def test_a_megatron_lm_null_tokenizer_checkpoint_is_compared_by_its_tokenizers_ids():
    """Megatron-LM records the --vocab-size given to its NullTokenizer, which has one id more (EOD)."""
    flags = BASE[: BASE.index("--vocab-size")] + BASE[BASE.index("--vocab-size") + 2 :]
    config = parse_run_config(flags + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1858"], GPT_DEFAULTS, 1)
    args = megatron_args(config.model, iteration=1, consumed_samples=0, tp=1, pp=1, extra={})
    args.tokenizer_type, args.vocab_size = "NullTokenizer", 1858
    assert args_mismatch(args, config.model) is None
    assert TransformerConfig(**config_fields(args)).vocab_size == 1859
    args.vocab_size = 1857
    assert args_mismatch(args, config.model) == (
        "saved with --tokenizer-type NullTokenizer --vocab-size 1857 (1858 ids with EOD), the flags give 1859 ids"
    )
