"""tools/bench/pipeline_overhead.py: per-step counts of ours and torch's 1F1B on every rank;
pipeline_stage_work.py: one stage's work by CPU time."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_overhead_counts_both_sides_on_every_rank():
    result = subprocess.run(
        [sys.executable, str(REPO / "tools/bench/pipeline_overhead.py"), "--microbatches", "4", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    rows = re.findall(r"^\s+(\d)\s+(ours|torch)\s+(\d+)\s+(\d+)\s+[\d.]+$", result.stdout, re.M)
    assert sorted((rank, side) for rank, side, _, _ in rows) == [
        ("0", "ours"),
        ("0", "torch"),
        ("1", "ours"),
        ("1", "torch"),
    ], result.stdout
    assert all(int(calls) > 0 and int(ops) > 0 for _, _, calls, ops in rows)
    assert re.search(r"ours/torch [\d.]+x the Python calls, [\d.]+x the aten ops", result.stdout)


def test_stage_work_compares_equal_gradients_by_cpu_time():
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools/bench/pipeline_stage_work.py"),
            "--quick",
            "--hidden",
            "16",
            "--tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"ours [\d.]+ ms, torch [\d.]+ ms, ours/torch [\d.]+ \(gradients equal", result.stdout), (
        result.stdout
    )
