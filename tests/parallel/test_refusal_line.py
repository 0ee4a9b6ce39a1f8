"""An error every rank raises alike reaches the user's terminal as one line, whichever rank exits first.

Rank 0 prints such an error; torchrun stops the other ranks as soon as one exits with an error.
Before the other ranks held their exit, rank 1 could exit first and torchrun stopped rank 0 before
it printed (2 launches in 12 printed nothing but torchrun's report). Each launch here must print
the line exactly once: several launches at 2 ranks and one at 8, for a flag every rank refuses
before the process group exists. (Errors agreed on after it, such as a damaged index file, are
among tests/parallel/test_bad_input.py's two-rank cases.)
"""

from __future__ import annotations

import re

import pytest

from tests.cli import run_cli

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"]
BATCH = [
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--train-iters",
    "2",
    "--mock-data",
    "--vocab-size",
    "64",
]
CASES = {
    # id -> (ranks, flags, text of the error line)
    "flag-2-ranks": (2, TINY[:-2] + ["--seq-length", "0"] + BATCH, "--seq-length"),
    "flag-8-ranks": (8, TINY[:-2] + ["--seq-length", "0"] + BATCH, "--seq-length"),
}
LAUNCHES = {"flag-2-ranks": 4, "flag-8-ranks": 1}


@pytest.mark.parametrize("case", list(CASES))
def test_agreed_error_prints_one_line_in_every_launch(case):
    ranks, flags, expected = CASES[case]
    for launch in range(LAUNCHES[case]):
        proc = run_cli("pretrain_gpt.py", flags, nproc=ranks)
        errors = [line for line in proc.stderr.splitlines() if re.match(r"(\S+: )?error: ", line)]
        assert proc.returncode != 0, proc.stderr[-2000:]
        assert len(errors) == 1 and expected in errors[0], (launch, proc.stderr[-3000:])
