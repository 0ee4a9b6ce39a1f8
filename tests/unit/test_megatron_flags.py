"""Every flag of Megatron-LM's arguments.py (tests/data/megatron_flags.txt, extracted from the
commit named in its header) is supported, accepted as a no-op with a start-up note, or refused
by name in one line; none is "unrecognized", and each value-taking flag consumes its values
(Megatron's nargs) so a value is never read as a flag. Pure parsing, no training."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron.training.arguments.megatron_flags import NO_OP_FLAGS, NO_OP_GROUP, classify
from megatron.training.arguments.parser import GPT_DEFAULTS, build_parser, parse_run_config

FLAGS_FILE = Path(__file__).resolve().parents[1] / "data" / "megatron_flags.txt"
TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "2",
    "--mock-data",
    "--vocab-size",
    "100",
    "--lr",
    "1e-3",
]


def _megatron_flags() -> dict[str, str]:
    """flag -> Megatron's nargs as written in the file: '0' (a switch), '1', '+', '*' or a count."""
    lines = FLAGS_FILE.read_text().splitlines()
    return dict(line.split() for line in lines if line and not line.startswith("#"))


def _supported() -> dict:
    """option string -> argparse action, for the parser's own (non-no-op) flags."""
    parser = build_parser(GPT_DEFAULTS)
    return {
        o: a
        for g in parser._action_groups
        if g.title != NO_OP_GROUP
        for a in g._group_actions
        for o in a.option_strings
    }


def _arity(nargs) -> str:
    return "0" if nargs == 0 else "1" if nargs is None else str(nargs)


MEGATRON = _megatron_flags()


def test_flag_list_names_its_megatron_commit_and_is_complete():
    header = FLAGS_FILE.read_text().split("\n--", 1)[0]
    assert re.search(r"NVIDIA/Megatron-LM commit [0-9a-f]{40}", header)
    assert len(MEGATRON) > 800 and all(flag.startswith("--") for flag in MEGATRON)


def test_every_megatron_flag_is_supported_no_op_or_refused():
    supported = _supported()
    unknown = [flag for flag in MEGATRON if flag not in supported and classify(flag) is None]
    assert not unknown, f"Megatron flags neither supported, no-op nor refused: {unknown}"
    both = [flag for flag in MEGATRON if flag in supported and classify(flag) is not None]
    assert not both, f"supported flags also listed as no-op or refused: {both}"


def test_accepted_flags_take_megatrons_number_of_values():
    actions = {**_supported(), **{o: a for a in build_parser(GPT_DEFAULTS)._actions for o in a.option_strings}}
    wrong = {
        flag: (nargs, _arity(actions[flag].nargs))
        for flag, nargs in MEGATRON.items()
        if flag in actions and _arity(actions[flag].nargs) != nargs
    }
    assert not wrong, f"flag: (Megatron's nargs, ours): {wrong}"


def _with_values(flag: str, nargs: str) -> list[str]:
    spec = NO_OP_FLAGS.get(flag)
    value = spec.values[0] if spec and spec.values else "1"
    return [flag] + [value] * (0 if nargs == "0" else int(nargs) if nargs.isdigit() else 2)


def test_every_no_op_flag_parses_with_its_values_and_is_noted_once():
    no_ops = {flag: nargs for flag, nargs in MEGATRON.items() if (classify(flag) or ("",))[0] == "no-op"}
    argv = list(TINY)
    for flag, nargs in no_ops.items():
        argv += _with_values(flag, nargs)
    notes = parse_run_config(argv, GPT_DEFAULTS, 1).notes
    fusion = [flag for flag in no_ops if flag not in NO_OP_FLAGS]
    assert len(notes) == len(no_ops) - len(fusion) + 1  # one line per flag, the --no-*-fusion switches in one
    for flag in no_ops:
        assert sum(f"{flag} " in note for note in notes) == 1, flag
    assert all("\n" not in note for note in notes)


def test_every_refused_flag_is_named_in_one_line():
    refused = [flag for flag in MEGATRON if (classify(flag) or ("",))[0] == "refused"]
    assert len(refused) > 400
    with pytest.raises(ValueError) as info:
        parse_run_config(
            TINY + [token for flag in refused for token in _with_values(flag, MEGATRON[flag])], GPT_DEFAULTS, 1
        )
    message = str(info.value)
    assert "\n" not in message and all(f" {flag} " in f"{message} ".replace(";", " ") for flag in refused)
    for flag in refused:
        with pytest.raises(ValueError, match=re.escape(flag)) as info:
            parse_run_config(TINY + _with_values(flag, MEGATRON[flag]), GPT_DEFAULTS, 1)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--optimizer", "sgd"], "--optimizer sgd"),
        (["--optimizer=muon"], "--optimizer muon"),
        (["--recompute-modules", "core_attn", "mlp", "--bf16"], "--recompute-modules mlp"),
        (["--dataloader-type", "cyclic"], "--dataloader-type cyclic"),
        (["--softmax-type", "learnable"], "softmax"),
    ],
)
def test_a_default_only_flag_refuses_other_values(argv, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        parse_run_config(TINY + argv, GPT_DEFAULTS, 1)


def test_a_default_only_flag_notes_its_value():
    notes = parse_run_config(TINY + ["--optimizer", "adam", "--recompute-modules", "core_attn"], GPT_DEFAULTS, 1).notes
    assert (
        "> note: --optimizer adam changes nothing here: Adam with decoupled weight decay is the only optimizer "
        "here" in notes
    )
    assert any(note.startswith("> note: --recompute-modules core_attn changes nothing here") for note in notes)


def test_megatron_spellings_of_supported_flags():
    config = parse_run_config(
        TINY
        + ["--use-rope-scaling", "--position-embedding-type", "rope", "--cp-comm-type", "all_gather", "all_gather"],
        GPT_DEFAULTS,
        1,
    )
    assert config.model.rope_scaling and config.model.cp_comm_type == "all_gather"
    with pytest.raises(ValueError, match="--cp-comm-type: one type for every layer only"):
        parse_run_config(TINY + ["--cp-comm-type", "p2p", "all_gather"], GPT_DEFAULTS, 1)
