"""A resumed run prints the uninterrupted run's iteration lines (loss, grad norm, learning rate,
loss scale, skipped and nan counts) for every iteration both print, at any log interval, and
both print at Megatron's intervals only: a save stores the open averaging window instead of
ending it (at interval 2 the save after iteration 3 falls inside the window 3-4)."""

from __future__ import annotations

import re

import pytest

from tests.cli import TINY_LLAMA, explain, run_cli

TRACKER = "latest_checkpointed_iteration.txt"
FIELDS = (
    "consumed samples",
    "learning rate",
    "lm loss",
    "loss scale",
    "grad norm",
    "number of skipped iterations",
    "number of nan iterations",
)


def _lines(stdout: str) -> dict[int, dict[str, str]]:
    """iteration -> the fields of its line that do not depend on timing."""
    out = {}
    for line in stdout.splitlines():
        found = re.search(r" iteration\s+(\d+)/", line)
        if found:
            fields = dict(re.findall(r" ([a-z ]+): ([^|]+?) \|", line))
            out[int(found.group(1))] = {name: fields.get(name) for name in FIELDS}
    return out


@pytest.mark.parametrize("interval", [1, 2])
def test_resumed_run_prints_the_uninterrupted_lines(tmp_path, interval):
    flags = TINY_LLAMA + [
        "--train-iters",
        "6",
        "--log-interval",
        str(interval),
        "--save",
        str(tmp_path),
        "--save-interval",
        "3",
    ]
    straight = run_cli("pretrain_llama.py", flags)
    assert straight.returncode == 0, explain(straight)
    (tmp_path / TRACKER).write_text("3")  # requeued after the save at iteration 3
    resumed = run_cli("pretrain_llama.py", flags + ["--load", str(tmp_path)])
    assert resumed.returncode == 0, explain(resumed)
    before, after = _lines(straight.stdout), _lines(resumed.stdout)
    assert sorted(before) == [i for i in range(1, 7) if i % interval == 0 or i in (1, 6)], straight.stdout
    expected = [i for i in range(4, 7) if i % interval == 0 or i == 6]
    assert sorted(after) == expected, resumed.stdout
    for iteration in expected:
        assert after[iteration] == before[iteration], (iteration, before[iteration], after[iteration])
        assert after[iteration]["grad norm"] is not None
