"""tools/gpu_check.py --dry-run --part all: the GPU self-check's code path on CPU at tiny sizes.

The report files exist and hold every section and row; the kernels' errors against fp32 are
finite and within the kernel tests' bf16 tolerance; speed and allocator cells say "n/a (dry run)"
rather than a number; the offload runs' losses equal their device runs'. Bad input is one
`error:` line and exit status 2.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.cli import explain, run_cli

NA = "n/a (dry run)"
SECTIONS = {
    "kernels": "Kernels (bf16) vs fp32 reference and torch",
    "train_step": "One-GPU training step",
    "memory": "Memory estimate vs the CUDA allocator",
    "offload_correctness": "Offload correctness",
    "offload_bytes": "Offload bytes",
    "offload_overlap": "Offload overlap",
    "size_fits": "Largest Llama that fits",
    "fp8": "FP8 training at the 8B layer shape",
    "fp8_layer": "One layer's FP8 product",
}
OFFLOAD_CONFIGS = [
    "distributed optimizer, device",
    "optimizer offload 1",
    "optimizer offload 0.5",
    "optim_grads_params, device",
    "host resident 1/1/1",
    "offload-policy auto",
    "distributed optimizer, device, fp32",
    "optimizer offload 1, fp32",
]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = run_cli("tools/gpu_check.py", ["--dry-run", "--part", "all", "--out", str(out)], timeout=120)
    assert proc.returncode == 0, explain(proc)
    assert "== Kernels" in proc.stdout and "report:" in proc.stdout
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def test_every_section_and_row(report):
    data, markdown = report
    sections = data["sections"]
    assert set(sections) == set(SECTIONS), sorted(sections)  # no "failures" section either
    for key, title in SECTIONS.items():
        assert sections[key]["title"].startswith(title) and f"## {sections[key]['title']}" in markdown
    kernels = sections["kernels"]["rows"]
    cases = {row["case"] for row in kernels}
    assert (
        sum(c.startswith("attention") for c in cases) == 8 and sum(c.startswith(("rms", "layer")) for c in cases) == 4
    )
    assert len(kernels) == 12 * 2 * 2  # ours and torch, forward and backward
    assert [r["configuration"] for r in sections["memory"]["rows"]] == [
        "recompute none, mbs 1",
        "recompute selective, mbs 1",
        "recompute full, mbs 1",
        "recompute none, mbs 4",
        "--optimizer-cpu-offload, mbs 1",
    ]
    for key in ("offload_correctness", "offload_bytes"):
        assert [r["configuration"] for r in sections[key]["rows"]] == OFFLOAD_CONFIGS
    assert len(sections["offload_overlap"]["rows"]) == 5  # the offloaded configurations
    assert [r["column"] for r in sections["size_fits"]["rows"]] == ["host resident", "plain AdamW"]
    for section in sections.values():
        for row in section["rows"]:
            assert next(iter(row.values())) in markdown


def test_kernel_errors_finite_and_small(report):
    for row in report[0]["sections"]["kernels"]["rows"]:
        assert not str(row["path"]).startswith("error"), row
        for column in ("max err", "mean err", "rel err"):
            assert math.isfinite(row[column]), row
        assert row["rel err"] <= 2e-2, row  # tests/kernels/checks.py: TOL[bf16]
        assert row["ms"] == row["rate"] == row["vs torch"] == NA
    paths = {row["path"] for row in report[0]["sections"]["kernels"]["rows"] if row["impl"] == "ours"}
    assert paths == {"triton (interpreter)"}


def test_runs_and_dry_run_cells(report):
    sections = report[0]["sections"]
    for row in sections["train_step"]["rows"]:
        assert math.isfinite(row["first loss"]) and math.isfinite(row["last loss"])
        assert row["step ms"] == row["tokens/s"] == row["MFU"] == row["host syncs/iter"] == NA
    for row in sections["memory"]["rows"]:
        assert row["ran"] == "yes" and row["certain GiB"] > 0 and row["max allocated GiB"] == NA
    for row in sections["offload_correctness"]["rows"]:
        assert row["verdict"] in ("reference", "equal"), row
    for row in sections["offload_bytes"]["rows"]:
        if row["configuration"] in ("optimizer offload 1", "optimizer offload 0.5", "host resident 1/1/1"):
            assert row["slab / estimate"] == 1.0, row  # the estimator's host column is the slab exactly
    for row in sections["offload_overlap"]["rows"]:
        assert row["d2h MiB"] > 0 and row["h2d MiB"] > 0 and row["copy ms"] == NA
    for row in sections["size_fits"]["rows"]:
        assert row["ran"] == "yes" and row["parameters"] > 0 and row["tokens/s"] == NA


@pytest.mark.parametrize(
    "flags",
    [
        ["--part", "everything", "--dry-run"],
        ["--part", "all", "--dry-run", "--only", "memory,speed"],
        ["--part", "all", "--dry-run", "--out", "tests/unit/test_gpu_check.py/out"],
        pytest.param(
            ["--part", "offload"],
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        ),
    ],
)
def test_bad_input_is_one_line(flags):
    proc = run_cli("tools/gpu_check.py", flags, timeout=60)
    assert proc.returncode == 2, explain(proc)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr


def test_only_runs_the_named_sections(tmp_path):
    flags = ["--dry-run", "--part", "kernels-step", "--only", "memory", "--out", str(tmp_path)]
    proc = run_cli("tools/gpu_check.py", flags, timeout=120)
    assert proc.returncode == 0, explain(proc)
    assert set(json.loads((tmp_path / "report.json").read_text())["sections"]) == {"memory"}


def test_fp8_rows_as_the_issue_names_them(report):
    """Issue 44's report columns and row names; on CPU our four runs train (finite losses, FP8 differing
    from BF16) and torchtitan's rows say why they did not run; the emulated product is near the exact one."""
    rows = report[0]["sections"]["fp8"]["rows"]
    assert [r["name"] for r in rows] == [
        "ours-bf16",
        "ours-tensorwise",
        "ours-delayed",
        "ours-blockwise",
        "torchtitan-bf16",
        "torchtitan-tensorwise",
        "torchtitan-rowwise",
    ]
    ours = {r["name"]: r for r in rows[:4]}
    assert all(math.isfinite(r["final_loss"]) and r["error"] is None and r["tokens_per_s"] == NA for r in rows[:4])
    assert all(ours[name]["final_loss"] != ours["ours-bf16"]["final_loss"] for name in list(ours)[1:])
    assert all(r["error"] and r["final_loss"] is None for r in rows[4:])
    (layer,) = report[0]["sections"]["fp8_layer"]["rows"]
    assert 0 < layer["emulated vs bf16 rel err"] < 0.08 and layer["_scaled_mm vs emulated max abs"] == NA
