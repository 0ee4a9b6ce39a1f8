"""tools/gpu_check.py --dry-run --part all: the GPU self-check's code path on CPU at tiny sizes.

The report files exist and hold every section and row; the kernels' errors against fp32 are
finite and within the kernel tests' bf16 tolerance; speed and allocator cells say "n/a (dry run)"
rather than a number; the offload runs' losses equal their device runs'; the offloaded CPU step in
the device's rounding gives the device's fp32 masters bit for bit; each size member ran in a process
of its own. The parts registry: order, budgets, every section importable. Bad input is one
`error:` line and exit status 2; --only and --skip pick sections.
"""

from __future__ import annotations

import json
import math
import re
import subprocess

import pytest
import torch

from tests.cli import explain, run_cli
from tools.gpu_check_lib import parts

NA = "n/a (dry run)"
SECTIONS = {
    "adam_bits": "AdamW, one shard, two steps",
    "adam_bits_runs": "Offload vs device, bf16 0.17B model",
    "kernels": "Kernels (bf16) vs fp32 reference and torch",
    "train_step": "One-GPU training step",
    "memory": "Memory estimate vs the CUDA allocator",
    "offload_correctness": "Offload correctness",
    "offload_bytes": "Offload bytes",
    "offload_overlap": "Offload overlap",
    "size_fits": "Largest Llama that fits",
    "attention_backends": "Attention: our kernel vs each SDPA backend",  # part throughput: test_gpu_check_throughput.py
    "throughput": "Throughput at the Llama-3-8B layer shape",
    "memory_limit": "Memory near the device's limit",
    "moe": "MoE experts (bf16, forward + backward)",
    "moe_models": "Whole MoE models on one GPU",
    "fp8": "FP8 training at the 8B layer shape",
    "fp8_layer": "One layer's FP8 product",
    "fp8_ops": "FP8 linear layer: GEMM vs quantisation",
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
    assert sum(c.startswith("lm head + cross entropy") for c in cases) == 1
    assert len(kernels) == 13 * 2 * 2  # ours and torch, forward and backward
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
    note = next(n for n in sections["size_fits"]["notes"] if n.startswith("each member ran in a fresh process"))
    pids = re.findall(r"\d+", note)
    assert len(pids) == len(set(pids)) == 3, note  # two member processes, neither of them the check's


def test_offloaded_step_in_device_rounding_is_bit_equal(report):
    sections = report[0]["sections"]
    rows = {row["compared"]: row for row in sections["adam_bits"]["rows"]}
    assert rows["offload CPU step, CPU single-tensor rounding"]["elements differing"] == 0  # the device here is a CPU
    assert rows["offload CPU step, torch's fused CPU AdamW (default)"]["elements differing"] > 0
    assert rows["offload CPU step, CUDA rounding emulated"]["elements differing"] > 0
    runs = sections["adam_bits_runs"]["rows"]
    assert [(r["CPU step rounding"], r["verdict"]) for r in runs] == [("-", "reference"), ("fused", "differs"),
                                                                      ("cpu", "bit-equal")]  # fmt: skip
    assert runs[1]["elements differing"] > 0 and runs[2]["elements"] == runs[0]["elements"] > 0


def test_moe_rows_and_host_syncs(report):
    sections = report[0]["sections"]
    rows = sections["moe"]["rows"]
    assert [(r["shape"], r["routing"]) for r in rows] == [
        (shape, routing) for shape in ("e8-top2", "e64-top6", "e128-top8") for routing in ("balanced", "skewed")
    ]
    for row in rows:  # no host sync in an MoE layer with the allgather dispatcher and grouped experts
        assert row["host_syncs_per_layer"] == 0 and row["grouped_ms"] == row["speedup"] == row["permute_gbps"] == NA
        parts = ("grouped_gemm_ms", "loop_gemm_ms", "permute_ms", "unpermute_ms")  # what limits a shape, apart
        assert all(row[name] == NA for name in parts)
    assert "alltoall 1 read(s) per layer" in " ".join(sections["moe"]["notes"])
    models = sections["moe_models"]["rows"]
    assert [r["name"] for r in models] == ["mixtral-like (2 layers)", "qwen3-moe-like (4 layers)"]
    for row in models:
        assert row["tokens_per_s"] == row["tflops"] == row["step_s"] == NA and row["projected_step_s"] > 0


@pytest.mark.parametrize(
    "flags",
    [
        ["--part", "everything", "--dry-run"],
        ["--part", "all", "--dry-run", "--only", "memory,speed"],
        ["--part", "all", "--dry-run", "--skip", "size,nosuch"],
        ["--part", "kernels-step", "--dry-run", "--only", "size"],
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


def test_skip_leaves_sections_out(tmp_path):
    flags = ["--dry-run", "--part", "kernels-step", "--skip", "kernels,step", "--out", str(tmp_path)]
    proc = run_cli("tools/gpu_check.py", flags, timeout=120)
    assert proc.returncode == 0, explain(proc)
    data = json.loads((tmp_path / "report.json").read_text())
    assert set(data["sections"]) == {"memory"}
    assert "section kernels wall s" not in data["meta"] and "section memory wall s" in data["meta"]


def test_sections_that_do_not_fit_are_skipped(tmp_path):
    """A GPU run (not a dry run) with 20 s of its part left starts no section that needs more."""
    from tools.gpu_check_lib.cli import parse, run_part
    from tools.gpu_check_lib.report import Report
    from tools.gpu_check_lib.runs import Context

    args = parse(["--part", "offload", "--skip", "offload"])
    report = Report({})
    run_part(report, tmp_path, args.parts[0], args, Context(torch.device("cpu"), False, 20.0))
    assert [s.key for s in report.sections] == ["sections_skipped"]
    rows = report.sections[0].rows
    assert [r["section"] for r in rows] == ["adam_bits", "size"]
    assert all(r["why"].startswith("skipped: 20 s of the part's 20 s budget left") for r in rows), rows
    assert json.loads((tmp_path / "report.json").read_text())["sections"]["sections_skipped"]["rows"] == rows


def test_parts_registry():
    ordered = parts.ordered()
    assert [p.order for p in ordered] == sorted(p.order for p in ordered)
    names = parts.section_names()
    assert len(names) == len(set(names))  # a section name picks one section
    for part in parts.PARTS:
        for _, target, need_s in part.sections:
            assert callable(parts.section_runner(target)) and 0 < need_s <= part.budget_s, target
    line = parts.budget_line()
    total = sum(p.budget_s for p in parts.PARTS)
    assert f"= {total:.0f} s of budgets against {parts.all_deadline_s():.0f} s" in line
    assert ("fits" in line) == (total <= parts.all_deadline_s())


def test_carried_wheels_list_and_wrapper():
    """wheels.txt pins one version of each wheel the device image lacks; the wrapper parses as bash."""
    lines = [line.split("#")[0].strip() for line in open("tools/gpu_check_lib/wheels.txt")]
    specs = [line for line in lines if line]
    names = [spec.split("==")[0] for spec in specs]
    assert all(re.fullmatch(r"[a-z0-9-]+==[0-9][0-9a-z.]*", spec) for spec in specs), specs
    assert len(names) == len(set(names)) and {"torchtitan", "torchao", "datasets"} <= set(names)
    assert dict(s.split("==") for s in specs)["torchtitan"] == "0.2.2"  # 0.3.0 needs a newer torch than the image's
    proc = subprocess.run(["bash", "-n", "tools/gpu_check_device.sh"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_gpu_run_is_in_the_runs_table():
    """docs/gpu-check.md's table of runs links every report in docs/gpu-results/ (a .json beside its .md)."""
    from pathlib import Path

    results = Path("docs/gpu-results")
    guide = Path("docs/gpu-check.md").read_text()
    runs = guide[guide.index("## Runs") : guide.index("### What the runs measured")]
    for report in sorted(results.iterdir()):
        assert report.suffix in (".md", ".json") and report.with_suffix(".md").exists(), report
        assert f"](gpu-results/{report.name})" in runs, f"{report.name} is not in docs/gpu-check.md's table of runs"


@pytest.mark.parametrize("experts, topk", [(8, 2), (64, 6), (128, 8)])
def test_moe_check_routings(experts, topk):
    from tools.gpu_check_lib.moe_check import SKEW, routing_map, rows_per_expert

    tokens = 512
    balanced, skewed = (rows_per_expert(tokens, experts, topk, r) for r in ("balanced", "skewed"))
    assert sum(balanced) == sum(skewed) == tokens * topk
    assert max(skewed) == round(SKEW * tokens * topk // experts) and max(balanced) - min(balanced) < experts
    mapping = routing_map(tokens, skewed, "cpu")
    assert mapping.sum(dim=0).tolist() == skewed and (mapping.sum(dim=1) == topk).all()


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
    layers = report[0]["sections"]["fp8_layer"]["rows"]
    assert [layer["scales"] for layer in layers] == ["per tensor", "1x128 / 128x128 blocks"]
    for layer in layers:
        assert 0 < layer["emulated vs bf16 rel err"] < 0.08 and layer["_scaled_mm vs emulated max abs"] == NA
    ops = report[0]["sections"]["fp8_ops"]["rows"]
    paths = {(row["op"], row["path"]) for row in ops if row["error"] is None and row["ms"] == NA}
    assert len(paths) == len(ops) and ("linear fwd + bwd", "fp8 delayed, triton casts") in paths
    assert {row["path"] for row in ops if row["op"].startswith("quantise")} >= {"torch", "triton"}


def test_fp8_torchtitan_rows_are_the_throughput_jobs_with_torchao_float8():
    """Part fp8's torchtitan rows: the throughput part's torchtitan job at 2 layers, compiled, with torchtitan
    0.2.2's float8 converter by recipe name (the output layer left out); parsed by torchtitan where it is here."""
    from types import SimpleNamespace

    from tools.gpu_check_lib.fp8_check import torchtitan_job
    from tools.gpu_check_lib.torchtitan_rows import config_argv

    ctx = SimpleNamespace(dry_run=False)
    bf16 = config_argv(torchtitan_job(ctx, None, None), "/tmp/dump")
    rowwise = config_argv(torchtitan_job(ctx, "rowwise", None), "/tmp/dump")
    assert "--model.converters" not in bf16 and "--compile.enable" in bf16
    pairs = dict(zip(rowwise[-6::2], rowwise[-5::2]))
    assert pairs == {
        "--model.converters": "quantize.linear.float8",
        "--quantize.linear.float8.recipe_name": "rowwise",
        "--quantize.linear.float8.filter_fqns": "output",
    }
    assert rowwise[rowwise.index("--model.flavor") + 1] == "8B-L2"
    config_manager = pytest.importorskip("torchtitan.config", reason="torchtitan 0.2.2 is carried to the GPU only")
    config = config_manager.ConfigManager().parse_args(rowwise)
    assert config.quantize.linear.float8.recipe_name == "rowwise" and config.compile.enable
