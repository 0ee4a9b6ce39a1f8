"""The GPU check's throughput part (issue 43): its dry run end to end, the cells of a row from a run's figures,
the per-layer time, a job in a process of its own, auto's measured attention rule and its path through the
dispatch, the memory configurations around a limit and their outcomes read back as the keep rule's data, and
the torchtitan custom import."""

from __future__ import annotations

import ast
import json
import zipfile
from pathlib import Path

import pytest
import torch

from kernels import attention_rule
from kernels.attention_rule import Measurement, fastest
from kernels.dispatch import kernel_paths
from tests.cli import ROOT, explain, run_cli
from tools.gpu_check_lib import memory_limit, throughput_check, torchtitan_rows
from tools.gpu_check_lib.attention_backends import measurements
from tools.gpu_check_lib.report import NA
from tools.gpu_check_lib.throughput_jobs import Job, run_job

NAMES = ["ours", "ours-best", "bare-eager", "bare-compile", "torchtitan-eager", "torchtitan-compile"]
COLUMNS = ["name", "layers", "tokens_per_s", "tflops_12lds", "mfu_12lds", "mfu_causal", "ms_per_layer",
           "peak_allocated_gib", "step_s", "projected_step_s", "final_loss"]  # fmt: skip


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("throughput")
    proc = run_cli("tools/gpu_check.py", ["--dry-run", "--part", "throughput", "--out", str(out)], timeout=120)
    assert proc.returncode == 0, explain(proc)
    return out / "report.json"


def test_dry_run_rows(report):
    sections = json.loads(report.read_text())["sections"]
    assert set(sections) == {"attention_backends", "throughput", "memory_limit"}, sorted(sections)
    rows = sections["throughput"]["rows"]
    assert sections["throughput"]["columns"] == COLUMNS
    assert [(r["name"], r["layers"]) for r in rows] == [(n, c) for c in (1, 2) for n in NAMES]
    for r in rows:
        if r["name"].startswith("torchtitan"):  # not in the CPU environment: every cell says why
            assert all(isinstance(r[c], str) and r[c] for c in COLUMNS[2:] if c != "projected_step_s")
            continue
        assert isinstance(r["final_loss"], float) and 4.0 < r["final_loss"] < 7.0  # ln(256) = 5.5: it trained
        assert r["tokens_per_s"] == r["step_s"] == r["peak_allocated_gib"] == NA
        assert isinstance(r["projected_step_s"], float) == r["name"].startswith("ours")
    attention = sections["attention_backends"]["rows"]
    assert [r["path"] for r in attention[:4]] == ["ours", "sdpa flash", "sdpa cudnn", "sdpa efficient"]
    assert attention[0]["correct"] is True and attention[1]["correct"] is True  # the interpreter, SDPA on CPU
    memory = sections["memory_limit"]["rows"]
    assert [r["start-up check"] != "refuses" for r in memory][:2] == [True, False]  # both sides of the limit
    assert all(r["ran"] == "yes" for r in memory)  # every one runs whatever the check says
    assert memory_limit.report_memory_runs(report) == []  # a dry run is no outcome


def _job(**fields):
    return Job("ours", False, 8, **fields)


def test_flops_and_row_cells():
    from megatron.planning.parameters import total_parameters
    from tools.gpu_check_lib.runs import run_config

    job = _job()
    assert total_parameters(run_config(job.argv()).model) == 2_795_573_248  # Llama-3-8B's layers, 8 of them
    full, causal, head_share = throughput_check.flops(job)
    tokens = 8 * 8192
    assert full - causal == 6 * 8 * 8192 * 4096 * tokens  # half of 12 L d s per token
    assert head_share == pytest.approx(6 * 4096 * 128256 * tokens / full)
    result = dict(losses=[11.0, 10.5], step_s=2.0, max_allocated=3 << 30, error=None)
    cells = throughput_check.row("ours", job, result, 1000.0, 1.9)
    assert cells["tokens_per_s"] == tokens / 2.0 and cells["tflops_12lds"] == pytest.approx(full / 2e12)
    assert cells["mfu_12lds"] == pytest.approx(full / 2e15) and cells["mfu_causal"] == pytest.approx(causal / 2e15)
    assert cells["peak_allocated_gib"] == 3.0 and cells["final_loss"] == 10.5 and cells["projected_step_s"] == 1.9
    oom = throughput_check.row("bare-eager", job, dict(result, error="out of memory", losses=[]), 1000.0, "x")
    assert oom["tokens_per_s"] == oom["mfu_causal"] == oom["final_loss"] == "out of memory"
    assert oom["peak_allocated_gib"] == 3.0  # measured up to the failure


def test_ms_per_layer_by_difference():
    rows = [
        dict(name="ours", layers=8, step_s=2.0, ms_per_layer="-"),
        dict(name="ours", layers=16, step_s=3.6, ms_per_layer="-"),
        dict(name="bare-eager", layers=8, step_s=2.2, ms_per_layer="-"),
        dict(name="bare-eager", layers=16, step_s="out of memory", ms_per_layer="-"),
    ]
    throughput_check.per_layer(rows, (8, 16))
    assert rows[0]["ms_per_layer"] == rows[1]["ms_per_layer"] == pytest.approx(200.0)
    assert rows[2]["ms_per_layer"] == "needs the 16-layer run: out of memory"


def test_job_in_a_process_of_its_own():
    job = Job("ours", True, 1, microbatches=2, warmup=1, iters=1)
    result = run_job(job, timeout_s=120)
    assert result["error"] is None and len(result["losses"]) == 2 and result["step_s"] == NA
    assert "unknown job kind" in run_job(Job("nonsense", True, 1), timeout_s=120)["error"]


def _measured(path, ms, seq=8192, correct=True, capability=(9, 0)):
    return Measurement(capability, 128, "bf16", seq, path, ms, correct, "test")


def test_auto_rule_fastest_correct_nearest_sequence():
    rows = [
        _measured("ours", 10.0),
        _measured("cudnn", 8.0),
        _measured("flash", 7.0, correct=False),  # fastest, but wrong: never taken
        _measured("flash", 1.0, seq=2048),
        _measured("efficient", 0.5, capability=(8, 0)),
    ]
    assert fastest(rows, (9, 0), 128, "bf16", 8192) == "cudnn"
    assert fastest(rows, (9, 0), 128, "bf16", 16384) == "cudnn"  # 8192 is the nearest measured
    assert fastest(rows, (9, 0), 128, "bf16", 3000) == "flash"  # 2048 is nearer than 8192
    assert fastest(rows, (8, 0), 128, "bf16", 8192) == "efficient"
    assert fastest(rows, (9, 0), 64, "bf16", 8192) is None and fastest(rows, (9, 0), 128, "fp16", 8192) is None


def test_auto_rule_through_the_dispatch(monkeypatch):
    common = dict(norm_impl="auto", head_dim=128, hidden_size=4096, dtype=torch.bfloat16, seq_length=8192)
    assert kernel_paths("cpu", attention_impl="auto", **common).sdpa_backend is None
    monkeypatch.setattr(attention_rule, "MEASURED", (_measured("ours", 10.0), _measured("cudnn", 8.0)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    paths = kernel_paths("cuda", attention_impl="auto", **common, assume_triton=True)
    assert (paths.attention, paths.sdpa_backend) == ("sdpa", "cudnn") and "measured fastest" in paths.attention_line
    forced = kernel_paths("cuda", attention_impl="triton", **common, assume_triton=True)
    assert forced.attention == "flash_attention" and forced.sdpa_backend is None  # a forced path stays
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert kernel_paths("cuda", attention_impl="auto", **common, assume_triton=True).attention == "flash_attention"


def test_attention_rows_become_measurements():
    case = "b1 s8192 h32 g8 d128 causal"
    rows = [
        {"case": case, "path": "ours", "correct": True, "fwd ms": 2.0, "bwd ms": 5.0},
        {"case": case, "path": "sdpa cudnn (K/V repeated: enable_gqa refused)", "correct": True, "fwd ms": 1.0,
         "bwd ms": 2.0},  # fastest, but our layers' grouped K/V would be refused: not taken
        {"case": case, "path": "sdpa flash", "correct": True, "fwd ms": 1.5, "bwd ms": 4.0},
        {"case": case, "path": "sdpa efficient", "correct": "error: RuntimeError: no"},
    ]  # fmt: skip
    found = measurements(rows, (9, 0), "bf16", "H200")
    assert [(m.path, m.seq_length, m.head_dim, m.ms) for m in found] == [
        ("ours", 8192, 128, 7.0),
        ("flash", 8192, 128, 5.5),
    ]
    assert fastest(found, (9, 0), 128, "bf16", 8192) == "flash"


def test_memory_configurations_straddle_the_limit(monkeypatch):
    class Estimate:
        def __init__(self, layers, micro_batch, recompute):
            work = layers * micro_batch * (0.5 if recompute == "full" else 1.0)
            self.decision = "refuses" if work > 21 else "fits"

    monkeypatch.setattr(
        memory_limit, "_decision", lambda dry, layers, mbs, recompute, device: Estimate(layers, mbs, recompute)
    )
    assert memory_limit.choose(False, 0, 2, 64) == [(20, 1, "none"), (22, 1, "none"), (22, 1, "full"), (20, 2, "none")]
    assert memory_limit.choose(False, 0, 30, 64) == []  # even the fewest layers refused
    assert memory_limit.choose(False, 0, 2, 20) == []  # the most layers start: no limit in reach


def test_memory_outcomes_feed_the_keep_rule(tmp_path):
    from tools.bench.fit_rule_outcomes import memory_run_model_and_layout
    from tools.bench.published_memory_outcomes import MemoryRun, own_runs

    def row(layers, mbs, recompute, ran, allocated):
        return {"configuration": f"L{layers} mbs{mbs} recompute {recompute}", "layers": layers, "micro batch": mbs,
                "recompute": recompute, "device GiB": 140.0, "ran": ran, "max allocated GiB": allocated}  # fmt: skip

    rows = [row(20, 1, "none", "yes", 120.0), row(22, 1, "none", "out of memory", 139.0)]
    rows.append(row(22, 1, "full", "skipped: 10 s of the part's 360 s budget left, 120 s needed", None))
    data = {"meta": {"dry run": False, "device": "NVIDIA H200"}, "sections": {"memory_limit": {"rows": rows}}}
    (tmp_path / "2026-12-01-h200.json").write_text(json.dumps(data))
    runs = own_runs(tmp_path)
    assert [(r.name, r.oom) for r in runs] == [
        ("ours L20 mbs1 recompute none", False),
        ("ours L22 mbs1 recompute none", True),
    ]
    assert runs[0].measured_gb == pytest.approx(120.0 * (1 << 30) / 1e9) and runs[1].measured_gb is None
    assert all(isinstance(r, MemoryRun) and r.num_gpus == 1 for r in runs)
    model, layout = memory_run_model_and_layout(runs[1])
    assert (model.num_layers, model.hidden_size, model.seq_length, layout.micro_batch_size) == (22, 4096, 8192, 1)
    data["meta"]["dry run"] = True
    (tmp_path / "2026-12-01-h200.json").write_text(json.dumps(data))
    assert own_runs(tmp_path) == ()


def test_torchtitan_wheels_and_command_line(tmp_path):
    path, why = torchtitan_rows.unpack_wheels(tmp_path)
    assert path is None and "no torchtitan wheel" in why
    with zipfile.ZipFile(tmp_path / "torchtitan-0.2.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr("torchtitan/__init__.py", "VERSION = 'test'\n")
    path, why = torchtitan_rows.unpack_wheels(tmp_path)
    assert (Path(path) / "torchtitan" / "__init__.py").read_text() == "VERSION = 'test'\n" and "0.2.2" in why
    argv = torchtitan_rows.config_argv(Job("torchtitan", False, 16, compile=True), "/tmp/dump")
    pairs = dict(zip(argv[::2], argv[1::2]))
    assert pairs["--model.flavor"] == "8B-L16" and pairs["--training.seq_len"] == "8192"
    assert (
        pairs["--training.global_batch_size"] == "8"
        and pairs["--experimental.custom_import"] == torchtitan_rows.CUSTOM_IMPORT
    )
    assert argv[-1] == "--compile.enable" and pairs["--activation_checkpoint.mode"] == "none"


def test_torchtitan_custom_import_module():
    source = (ROOT / "tools" / "gpu_check_lib" / "torchtitan_custom.py").read_text()
    ast.parse(source)  # imported only where torchtitan is; here at least it parses
    pytest.importorskip("torchtitan.train", reason="torchtitan 0.2.2 is not installed here (the GPU check carries it)")
    from tools.gpu_check_lib import torchtitan_custom

    args = torchtitan_custom.TRAIN_SPEC.model_args["8B-L8"]
    with torch.device("meta"):
        model = torchtitan_custom.TRAIN_SPEC.model_cls(args)
    assert sum(p.numel() for p in model.parameters()) == 2_795_573_248  # ours at 8 layers, the same shape
    with pytest.raises(KeyError):
        torchtitan_custom.TRAIN_SPEC.model_args["70B"]


def test_auto_pins_cudnn_where_the_h200_measured_it_fastest():
    """The committed measurements (docs/gpu-results/2026-11-28-h200.json): on compute capability 9.0, head dim
    128, bf16, cuDNN's SDPA was the fastest correct path at seq 2048 and 8192; nothing else is decided by them."""
    assert attention_rule.fastest(attention_rule.MEASURED, (9, 0), 128, "bf16", 8192) == "cudnn"
    assert attention_rule.fastest(attention_rule.MEASURED, (9, 0), 128, "bf16", 4096) == "cudnn"
    assert attention_rule.fastest(attention_rule.MEASURED, (9, 0), 64, "bf16", 8192) is None
    assert attention_rule.fastest(attention_rule.MEASURED, (8, 0), 128, "bf16", 8192) is None


def test_ours_over_the_best_peer_of_the_same_run():
    rows = [
        dict(name="ours", layers=8, tokens_per_s=34507.3),
        dict(name="ours-best", layers=8, tokens_per_s="timed out after 30 s"),
        dict(name="bare-eager", layers=8, tokens_per_s=31909.8),
        dict(name="bare-compile", layers=8, tokens_per_s=35151.4),
        dict(name="torchtitan-compile", layers=8, tokens_per_s="skipped: 10 s left, 40 s needed"),
        dict(name="bare-compile", layers=16, tokens_per_s=99999.0),  # another layer count: not compared
    ]
    line = throughput_check.versus_best_peer(rows, 8)
    assert line.startswith("ours / best peer at 8 layers, tokens/s in this run: ours 0.982x, ours-best not measured")
    assert "of bare-compile (35,151.4); peers not measured: torchtitan-compile" in line
    dry = [dict(name=n, layers=1, tokens_per_s=NA) for n in NAMES]
    assert throughput_check.versus_best_peer(dry, 1).startswith("ours / best peer at 1 layers: no peer measured")
