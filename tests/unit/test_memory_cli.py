"""tools/estimate_memory.py, tools/plan_parallelism.py and the start-up check: output, exit codes, errors."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.training.arguments import LLAMA_DEFAULTS, parse_run_config
from megatron.training.memory_check import check_memory

REPO = Path(__file__).resolve().parents[2]
LLAMA_7B = ["--model-family", "llama", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "11008",
            "--num-attention-heads", "32", "--seq-length", "4096", "--vocab-size", "32000", "--bf16",
            "--micro-batch-size", "1", "--global-batch-size", "64"]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--vocab-size", "100", "--micro-batch-size", "2", "--global-batch-size", "8"]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


estimate_tool = _load("estimate_memory")
plan_tool = _load("plan_parallelism")


def run_tool(module, argv, capsys):
    code = module.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_table_and_fit(capsys):
    argv = ["--num-gpus", "8", "--device-memory-gb", "80", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2", "--sequence-parallel"] + LLAMA_7B
    code, out, err = run_tool(estimate_tool, argv, capsys)
    assert code == 0 and not err
    assert "weights" in out and "activations" in out and "% device" in out
    assert "total parameters 6,738,415,616" in out
    assert len([line for line in out.splitlines() if line.strip().split(" ")[0] in ("0", "1")]) == 2


def test_json_keys(capsys):
    argv = ["--num-gpus", "4", "--device-memory-gb", "80", "--pipeline-model-parallel-size", "2", "--json",
            "--use-distributed-optimizer"] + LLAMA_7B
    code, out, _ = run_tool(estimate_tool, argv, capsys)
    data = json.loads(out)
    assert code == 0 and data["fits"] is True
    for key in ("ranks", "total_parameters", "max_total_bytes", "device_memory_bytes", "fits"):
        assert key in data
    assert [r["pp_rank"] for r in data["ranks"]] == [0, 1]
    for rank in data["ranks"]:
        for key in ("pp_rank", "parameters", "weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                    "transients_bytes", "host_bytes", "total_bytes"):
            assert key in rank
        assert rank["host_bytes"] == 0
    assert data["total_parameters"] == 6_738_415_616
    assert sum(r["parameters"] for r in data["ranks"]) == 6_738_415_616
    assert data["device_memory_bytes"] == 80 << 30
    # the distributed optimizer shards fp32 master + m + v (12 bytes) over dp = 2
    assert data["ranks"][0]["optimizer_bytes"] == 12 * data["ranks"][0]["parameters"] // 2


def test_exit_1_when_above_threshold(capsys):
    code, out, _ = run_tool(estimate_tool, ["--num-gpus", "1", "--device-memory-gb", "80"] + LLAMA_7B, capsys)
    assert code == 1 and "does NOT fit" in out


def test_without_device_memory_it_only_reports(capsys):
    code, out, _ = run_tool(estimate_tool, ["--num-gpus", "1", "--device-type", "cpu"] + TINY, capsys)
    assert code == 0 and "pass --device-memory-gb" in out


@pytest.mark.parametrize("argv,message", [
    (TINY, "the following arguments are required: --num-gpus"),
    (["--num-gpus", "2"] + [t for t in TINY if t not in ("--vocab-size", "100")], "--vocab-size is required"),
    (["--num-gpus", "3", "--tensor-model-parallel-size", "2"] + TINY, "world size 3 is not divisible"),
    (["--num-gpus", "2", "--tensor-model-parallel-size", "2", "--num-query-groups", "3",
      "--group-query-attention"] + TINY, "--num-attention-heads (4) must be divisible by --num-query-groups (3)"),
    (["--num-gpus", "2", "--context-parallel-size", "3"] + TINY, "multiple of --context-parallel-size"),
    (["--num-gpus", "2", "--device-memory-gb", "-1"] + TINY, "--device-memory-gb must be > 0"),
    (["--num-gpus", "2", "--model-family", "bert"] + TINY, "invalid choice: 'bert'"),
])
def test_invalid_input_exit_2_one_line(argv, message, capsys):
    code, out, err = run_tool(estimate_tool, argv, capsys)
    assert code == 2 and not out
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_real_process_exit_codes():
    """End to end: exit status and a single error line without traceback."""
    cmd = [sys.executable, str(REPO / "tools" / "estimate_memory.py")]
    bad = subprocess.run(cmd + TINY, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    big = subprocess.run(cmd + ["--num-gpus", "1", "--device-memory-gb", "1"] + LLAMA_7B, capture_output=True,
                         text=True)
    assert big.returncode == 1, big.stderr


def test_planner_prints_ranked_layouts(capsys):
    argv = ["--num-gpus", "8", "--device-memory-gb", "4", "--micro-batch-size", "1", "2"] + TINY[:-4] + [
        "--global-batch-size", "16"]
    code, out, err = run_tool(plan_tool, argv, capsys)
    assert code == 0, err
    assert "only cp=1 planned" in out and "rank  tp  cp  pp" in out
    rows = [line for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert 1 <= len(rows) <= 10


def test_planner_exit_codes(capsys):
    argv = ["--num-gpus", "1", "--device-memory-gb", "80"] + LLAMA_7B[:-4] + ["--global-batch-size", "8"]
    code, out, _ = run_tool(plan_tool, argv, capsys)
    assert code == 1 and "no layout fits" in out
    code, _, err = run_tool(plan_tool, ["--num-gpus", "8", "--device-memory-gb", "80"] + TINY[:-2], capsys)
    assert code == 2 and "--global-batch-size is required" in err


def _run(argv, world=1):
    return parse_run_config(argv + ["--train-iters", "1", "--mock-data"], LLAMA_DEFAULTS, world)


def test_check_memory_refuses_and_skips():
    run = _run(LLAMA_7B[2:])
    with pytest.raises(ValueError, match="exceeds device memory 80.00 GiB.*--skip-memory-check"):
        check_memory(run, torch.device("cpu"), 80.0, skip=False)
    lines = check_memory(run, torch.device("cpu"), 80.0, skip=True)
    assert lines[-1].startswith("> WARNING (--skip-memory-check)")
    assert any(line.strip().startswith("0 ") for line in lines)


def test_check_memory_passes_and_reports():
    run = _run(TINY)
    lines = check_memory(run, torch.device("cpu"), 80.0, skip=False)
    assert lines[-1].startswith("> memory check: estimated peak") and "0% of device memory" in lines[-1]
    assert check_memory(run, torch.device("cpu"), None, skip=False)[-1].endswith("not checked")
