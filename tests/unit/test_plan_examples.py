"""The planner takes a launch script's flags as training does: every script in examples/ runs with its
launchers stubbed (torchrun, srun, scontrol and the interpreter record what they would start), and
tools/plan_parallelism.py, given the flags the script passes to pretrain_*.py and the script's GPUs,
accepts them and plans only layouts with the tp, cp, pp, virtual stages, micro batch and recomputation
that training derives from the same flags (flags the script leaves out stay free)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from megatron.training.arguments.tool_command_line import run_config_for_tool
from tests.unit.test_memory_cli import plan_tool

ROOT = Path(__file__).resolve().parents[2]
# each script's GPUs (its comment's layout) and the environment that sizes its job
SCRIPTS = {
    "gpt3_8gpu.sh": (8, {}),
    "llama_8gpu.sh": (8, {}),
    "train_tiny_cpu.sh": (16, {}),
    "gpt3_slurm.sbatch": (64, {"SLURM_NNODES": "8"}),
    "llama_slurm.sbatch": (32, {"SLURM_NNODES": "4"}),
    "train_tiny_cpu_slurm.sbatch": (2, {"SLURM_NNODES": "1", "SLURM_NTASKS": "2"}),
}
RECORDER = """#!/usr/bin/env bash
# records the command line of a pretrain_*.py start, else does nothing (pip, preprocessing, torch checks)
for arg in "$@"; do
  case "$arg" in *pretrain_*.py) printf '%s\\0' "$@" > "$RECORD"; exit 0 ;; esac
done
exit 0
"""
SRUN = """#!/usr/bin/env bash
# one task: the command after srun's own options
while [ "${1#-}" != "$1" ]; do shift; done
exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && echo node1
exit 0
"""


def _stub(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def launched_flags(script: str, tmp_path: Path, env: dict) -> tuple[str, list[str]]:
    """(the pretrain script, its flags) that examples/`script` starts, run from a copy of the checkout's
    layout in tmp_path (examples, tools and data linked) so that nothing is written into the checkout."""
    tree, bin_dir = tmp_path / "tree", tmp_path / "venv" / "bin"
    tree.mkdir()
    bin_dir.mkdir(parents=True)
    for name in ("examples", "tools", "data"):
        (tree / name).symlink_to(ROOT / name)
    for name, text in (("python", RECORDER), ("torchrun", RECORDER), ("srun", SRUN), ("scontrol", SCONTROL)):
        _stub(bin_dir / name, text)
    record = tmp_path / "launched"
    slurm = {
        "SLURM_JOB_ID": "1",
        "SLURM_JOB_NAME": "plan",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_SUBMIT_DIR": str(tree),
    }
    environment = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "VIRTUAL_ENV": str(tmp_path / "venv"),
        "RECORD": str(record),
        "CKPT": str(tmp_path / "ckpt"),
        "STEP_EXIT_GRACE": "1",
        **slurm,
        **env,
    }
    proc = subprocess.run(
        ["bash", str(tree / "examples" / script)], cwd=tree, env=environment, capture_output=True, text=True
    )
    assert proc.returncode == 0 and record.exists(), proc.stdout + proc.stderr
    argv = record.read_text().split("\0")[:-1]
    start = next(i for i, arg in enumerate(argv) if arg.endswith(".py") and "pretrain_" in arg)
    return Path(argv[start]).name, argv[start + 1 :]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_planner_accepts_each_launch_scripts_flags_and_fixes_what_they_fix(script, tmp_path, capsys, monkeypatch):
    num_gpus, env = SCRIPTS[script]
    pretrain, flags = launched_flags(script, tmp_path, env)
    family = "llama" if pretrain == "pretrain_llama.py" else "gpt"
    monkeypatch.chdir(ROOT)  # the scripts' relative paths (tokenizer files) are the checkout's
    run = run_config_for_tool(flags, family, num_gpus, "pretrain")  # the layout training derives
    device = ["--device-type", "cpu", "--device-memory-gb", "64"] if "cpu" in script else ["--device", "h100-80gb"]
    argv = ["--num-gpus", str(num_gpus), "--model-family", family, "--top", "2", "--json"] + device + flags
    code = plan_tool.main(argv)
    out, err = capsys.readouterr()
    assert code == 0 and not err, err
    layouts = json.loads(out)
    assert layouts
    parallel, model = run.parallel, run.model
    fixed = {
        "--tensor-model-parallel-size": ("tp", parallel.tp),
        "--context-parallel-size": ("cp", parallel.cp),
        "--pipeline-model-parallel-size": ("pp", parallel.pp),
        "--num-layers-per-virtual-pipeline-stage": ("virtual_stages", parallel.virtual_stages),
        "--num-virtual-stages-per-pipeline-rank": ("virtual_stages", parallel.virtual_stages),
        "--micro-batch-size": ("micro_batch_size", run.training.micro_batch_size),
        "--recompute-method": ("recompute_method", model.recompute_method),
        "--recompute-num-layers": ("recompute_num_layers", model.recompute_num_layers),
    }
    for layout in layouts:
        for flag, (key, value) in fixed.items():
            if flag in flags:
                assert layout[key] == value, (flag, layout)
        if "--recompute-granularity" in flags:
            assert layout["recompute"] == model.recompute_granularity, layout


def test_every_launch_script_is_planned():
    assert sorted(p.name for p in (ROOT / "examples").iterdir() if p.suffix in (".sh", ".sbatch")) == sorted(SCRIPTS)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--num-layers-per-virtual-pipeline-stage", "2"],
            "virtual pipeline stages need --pipeline-model-parallel-size > 1",
        ),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
            ],
            "give only one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank",
        ),
        (
            ["--recompute-granularity", "selective", "--recompute-method", "uniform"],
            "--recompute-method only applies with --recompute-granularity full",
        ),
        (
            ["--recompute-activations", "--recompute-granularity", "full"],
            "--recompute-activations (selective) contradicts --recompute-granularity full",
        ),
    ],
)
def test_planner_refuses_what_training_refuses(flags, message, capsys):
    argv = ["--num-gpus", "4", "--device", "h100-80gb", "--num-layers", "4", "--hidden-size", "64"]
    argv += ["--num-attention-heads", "4", "--seq-length", "64", "--vocab-size", "128", "--global-batch-size", "8"]
    pp = ["--pipeline-model-parallel-size", "1"] if flags[0].startswith("--num-layers-per") else []
    assert plan_tool.main(argv + pp + flags) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
