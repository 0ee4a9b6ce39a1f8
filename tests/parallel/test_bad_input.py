"""Bad input at every entry point: exit status 2, one error line, no frame of our files, nothing
written (no checkpoint directory, inputs unchanged; a data index cache may be).

A table of bad flags, data, tokenizer files, checkpoints and converter inputs, each run as a user
would (under torchrun with two ranks where ranks could disagree). torchrun's own failure report
(frames of torch's launcher) is allowed; a traceback through megatron/, kernels/ or tools/ is not.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest

from tests.cli import GPT2_BPE, ROOT, TINY_LLAMA, run_cli

OUR_FRAME = re.compile(r'File "' + re.escape(str(ROOT)) + r"/(megatron|kernels|tools|pretrain_)")
GPT = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "2",
    "--train-iters",
    "2",
]


def _data(corpus: str, tmp_path, damage=None) -> list[str]:
    """--data-path flags for a copy of the corpus, optionally damaged by `damage(prefix)`."""
    prefix = str(tmp_path / "copy")
    for suffix in (".bin", ".idx"):
        shutil.copy(corpus + suffix, prefix + suffix)
    if damage is not None:
        damage(prefix)
    return ["--data-path", prefix] + GPT2_BPE


def _truncate_index(prefix: str) -> None:
    with open(prefix + ".idx", "r+b") as handle:
        handle.truncate(os.path.getsize(prefix + ".idx") - 16)


def _bad_tracker(tmp_path) -> list[str]:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("abc")
    return ["--load", str(ckpt)]


# id -> (script, nproc, flags builder(corpus, tmp_path), the error line's expected text)
CASES = {
    "tp-not-dividing": (
        "pretrain_llama.py",
        2,
        lambda c, t: TINY_LLAMA + ["--tensor-model-parallel-size", "3"],
        "--tensor-model-parallel-size",
    ),
    "truncated-idx": ("pretrain_gpt.py", 2, lambda c, t: GPT + _data(c, t, _truncate_index), "copy.idx"),
    "empty-test-split": (
        "pretrain_gpt.py",
        2,
        lambda c, t: GPT + _data(c, t) + ["--split", "998,1,1", "--eval-iters", "50"],
        "split",
    ),
    "missing-vocab": (
        "pretrain_gpt.py",
        1,
        lambda c, t: (
            GPT
            + [
                "--data-path",
                c,
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                str(t / "no.json"),
                "--merge-file",
                str(t / "no.txt"),
            ]
        ),
        "no.json",
    ),
    "bad-tracker": ("pretrain_llama.py", 2, lambda c, t: TINY_LLAMA + _bad_tracker(t), "expected an iteration number"),
    "convert-missing-dir": (
        "tools/checkpoint/convert.py",
        1,
        lambda c, t: [
            "--loader",
            "canonical",
            "--saver",
            "hf",
            "--load-dir",
            str(t / "none"),
            "--save-dir",
            str(t / "hf"),
        ],
        "no checkpoint",
    ),
    "convert-hf-without-config": (
        "tools/checkpoint/convert.py",
        1,
        lambda c, t: ["--loader", "hf", "--saver", "canonical", "--load-dir", str(t), "--save-dir", str(t / "out")],
        "config.json",
    ),
    "preprocess-missing-input": (
        "tools/preprocess_data.py",
        1,
        lambda c, t: (
            ["--input", str(t / "none.jsonl"), "--output-prefix", str(t / "out")] + GPT2_BPE + ["--workers", "1"]
        ),
        "none.jsonl",
    ),
    "inspect-missing-data": (
        "tools/inspect_data.py",
        1,
        lambda c, t: ["--data-path", str(t / "none"), "--seq-length", "16", "--train-samples", "4"] + GPT2_BPE,
        "none",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_without_our_traceback(case, corpus, tmp_path):
    script, nproc, flags, expected = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    argv = flags(corpus, work) + (["--save", str(tmp_path / "saved")] if script.startswith("pretrain") else [])
    before = {name: os.path.getsize(work / name) for name in os.listdir(work)}
    proc = run_cli(script, argv, nproc=nproc)
    assert proc.returncode != 0 and (nproc > 1 or proc.returncode == 2), (proc.returncode, proc.stderr[-2000:])
    errors = [line for line in proc.stderr.splitlines() if re.match(r"(\S+: )?error: ", line)]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-3000:]
    assert not OUR_FRAME.search(proc.stderr), proc.stderr[-3000:]
    if nproc > 1:  # torchrun reports each rank's exit status: 2, never a Python exception of ours
        assert "exitcode  : 2" in proc.stderr or "exit code 2" in proc.stderr or "exitcode: 2" in proc.stderr, (
            proc.stderr[-3000:]
        )
    assert not os.path.exists(tmp_path / "saved")
    assert all(os.path.getsize(work / name) == size for name, size in before.items())  # the inputs are untouched
