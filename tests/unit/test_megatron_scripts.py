"""Megatron-LM's dense example scripts run unchanged: the flag lists of
examples/gpt3/train_gpt3_175b_distributed.sh and examples/llama/train_llama3_8b_h100_fp8.sh
(written out here; sizes scaled down, paths pointed at local data; the FP8 flags kept, emulated on CPU) go
through pretrain_*.py and train 2 iterations on CPU. Also: out-of-scope flags are refused in one
message, the flag table in docs/megatron-lm.md is the parser's, and the log's Megatron timing (first iteration
always logged, memory line). Every other Megatron flag: test_megatron_flags.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.arguments.megatron_flags import compatibility_table
from megatron.training.arguments.parser import GPT_DEFAULTS, build_parser, parse_run_config

ROOT = Path(__file__).resolve().parents[2]
TOKENIZERS = ROOT / "data" / "tokenizers" / "gpt2-bpe"


def gpt3_175b_flags(data_prefix: str, out: Path) -> list[str]:
    model = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--max-position-embeddings",
        "32",
        "--attention-backend",
        "auto",
    ]
    training = [
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "4",
        "--step-batch-size-schedule",
        "0:2 64:4",
        "--train-iters",
        "2",
        "--weight-decay",
        "0.1",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--init-method-std",
        "0.006",
        "--clip-grad",
        "1.0",
        "--fp16",
        "--lr",
        "6.0e-5",
        "--lr-decay-style",
        "cosine",
        "--min-lr",
        "6.0e-6",
        "--lr-warmup-fraction",
        ".001",
        "--lr-decay-iters",
        "430000",
    ]
    parallel = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
    # the published script has no --tokenizer-type, which Megatron-LM itself requires (its build_tokenizer
    # fails on None); the one flag added here
    data = [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--data-path",
        data_prefix,
        "--vocab-file",
        str(TOKENIZERS / "vocab.json"),
        "--merge-file",
        str(TOKENIZERS / "merges.txt"),
        "--split",
        "949,50,1",
    ]
    logging = [
        "--log-interval",
        "100",
        "--save-interval",
        "10000",
        "--eval-interval",
        "1000",
        "--save",
        str(out / "ckpt"),
        "--load",
        str(out / "ckpt"),
        "--eval-iters",
        "10",
        "--tensorboard-dir",
        str(out / "tb"),
    ]
    return model + training + parallel + data + logging


def llama3_8b_flags(out: Path) -> list[str]:
    model = [
        "--use-mcore-models",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--ffn-hidden-size",
        "128",
        "--num-attention-heads",
        "4",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--kv-channels",
        "16",
        "--seq-length",
        "32",
        "--max-position-embeddings",
        "32",
        "--position-embedding-type",
        "rope",
        "--rotary-base",
        "1000000",
        "--rotary-percent",
        "1.0",
        "--attention-dropout",
        "0.0",
        "--hidden-dropout",
        "0.0",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--init-method-std",
        "0.0134",
        "--attention-backend",
        "fused",
        "--apply-layernorm-1p",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
    ]
    training = [
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "4",
        "--train-samples",
        "8",
        "--lr-decay-samples",
        "6",
        "--lr-warmup-samples",
        "2",
        "--lr",
        "0.00015",
        "--min-lr",
        "0.00001",
        "--decoupled-lr",
        "5.0e-4",
        "--decoupled-min-lr",
        "4.5e-5",
        "--lr-decay-style",
        "cosine",
        "--clip-grad",
        "1.0",
        "--weight-decay",
        "0.1",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--bf16",
        "--fp8-format",
        "hybrid",
        "--fp8-amax-history-len",
        "1024",
        "--fp8-amax-compute-algo",
        "max",
        "--fp8-param-gather",
        "--grad-reduce-in-bf16",
        "--cross-entropy-loss-fusion",
        "--calculate-per-token-loss",
        "--manual-gc",
        "--empty-unused-memory-level",
        "1",
        "--exit-duration-in-mins",
        "235",
    ]
    parallel = [
        "--tensor-model-parallel-size",
        "1",
        "--context-parallel-size",
        "1",
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
    ]
    data = [
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "128",
        "--data-cache-path",
        str(out / "cache"),
        "--tiktoken-pattern",
        "v2",
        "--split",
        "99,1,0",
        "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files",
        "--num-workers",
        "1",
    ]
    logging = [
        "--log-interval",
        "1",
        "--eval-iters",
        "32",
        "--eval-interval",
        "100",
        "--save-interval",
        "1000",
        "--log-throughput",
        "--profile",
        "--profile-step-start",
        "0",
        "--profile-step-end",
        "1",
        "--ckpt-format",
        "torch_dist",
        "--distributed-timeout-minutes",
        "60",
        "--save",
        str(out / "ckpt"),
        "--load",
        str(out / "ckpt"),
        "--tensorboard-dir",
        str(out / "tb"),
    ]
    return model + training + parallel + data + logging


def _run(script: str, flags: list[str]) -> subprocess.CompletedProcess:
    if "--load" in flags:  # Megatron starts fresh from a missing --load directory; ours wants it to exist
        Path(flags[flags.index("--load") + 1]).mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, str(ROOT / script)] + flags,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )


@pytest.fixture(scope="module")
def gpt_data(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("corpus")
    corpus = out / "stories.jsonl"  # four copies: --split 949,50,1 then leaves documents for the test split
    corpus.write_text((ROOT / "data" / "corpus" / "stories.jsonl").read_text() * 4)
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "preprocess_data.py"),
            "--input",
            str(corpus),
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            str(TOKENIZERS / "vocab.json"),
            "--merge-file",
            str(TOKENIZERS / "merges.txt"),
            "--append-eod",
            "--output-prefix",
            str(out / "stories"),
            "--workers",
            "1",
        ],
        check=True,
        capture_output=True,
        cwd=ROOT,
        timeout=300,
    )
    return str(out / "stories_text_document")


def _iterations(stdout: str) -> list[int]:
    return [int(n) for n in re.findall(r"^ \[[\d\- :.]+\] iteration +(\d+)/", stdout, flags=re.M)]


def test_gpt3_175b_script_trains(gpt_data, tmp_path):
    proc = _run("pretrain_gpt.py", gpt3_175b_flags(gpt_data, tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _iterations(proc.stdout) == [1, 2], proc.stdout[-2000:]
    assert "global batch size:     2" in proc.stdout  # the step schedule: 2 until 64 tokens (2 samples)


def test_llama3_8b_script_trains(tmp_path):
    proc = _run("pretrain_llama.py", llama3_8b_flags(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _iterations(proc.stdout) == [1, 2], proc.stdout[-2000:]
    for flag in ("--use-mcore-models", "--grad-reduce-in-bf16", "--manual-gc", "--tiktoken-pattern"):
        assert f"> note: {flag} changes nothing here" in proc.stdout
    assert "> note: --fp8-param-gather: the distributed optimizer gathers the weights in their own dtype" in proc.stdout
    assert "> fp8: delayed scaling, format hybrid, wgrad FP8; linear layers' GEMMs: emulated" in proc.stdout
    assert re.search(
        r"^\[Rank 0\] \(after 1 iterations\) memory \(MB\) \| resident: [\d.]+ \| max resident", proc.stdout, flags=re.M
    )
    assert list((tmp_path / "tb" / "profile").glob("trace_rank0_*.json")), "no profiler trace written"


def test_first_iteration_is_always_logged(tmp_path):
    flags = [
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
        "6",
        "--mock-data",
        "--vocab-size",
        "100",
        "--lr",
        "1e-3",
        "--log-interval",
        "5",
        "--wandb-project",
        "p",
    ]
    proc = _run("pretrain_gpt.py", flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _iterations(proc.stdout) == [1, 5, 6]
    assert "wandb is not installed" in proc.stderr or "wandb" in sys.modules


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


def test_out_of_scope_flags_are_refused_in_one_message():
    with pytest.raises(ValueError) as info:
        parse_run_config(
            TINY
            + [
                "--moe-enable-deepep",
                "--overlap-moe-expert-parallel-comm",
                "--fp4-format",
                "e2m1",
                "--multi-latent-attention",
                "--use-torch-fsdp2",
                "--vision-backbone-type",
                "x",
            ],
            GPT_DEFAULTS,
            1,
        )
    message = str(info.value)
    assert "\n" not in message
    for flag in (
        "--moe-enable-deepep",
        "--overlap-moe-expert-parallel-comm",
        "--fp4-format",
        "--multi-latent-attention",
        "--use-torch-fsdp2",
        "--vision-backbone-type",
    ):
        assert flag in message


def test_flag_table_in_docs_is_generated_from_the_parser():
    guide = (ROOT / "docs" / "megatron-lm.md").read_text()
    table = compatibility_table(build_parser(GPT_DEFAULTS))
    assert table in guide, "regenerate with: python tools/megatron_flag_table.py (paste it into docs/megatron-lm.md)"
