"""Every validation error of the command line names the flag and what would be valid."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece
import torch

from megatron.training.arguments.parser import GPT_DEFAULTS, LLAMA_DEFAULTS, parse_run_config
from megatron.training.kernel_paths import startup_kernel_paths

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--num-layers",
    "4",
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
]


def parse(extra, world_size=1, defaults=GPT_DEFAULTS):
    return parse_run_config(TINY + extra, defaults, world_size)


ERRORS = [
    (
        ["--split-backward"],
        1,
        "--split-backward only changes pipeline schedules: it needs --pipeline-model-parallel-size > 1",
    ),
    (
        ["--tensor-model-parallel-size", "2"],
        3,
        "world size 3 is not divisible by --tensor-model-parallel-size (2) x --context-parallel-size (1) x "
        "--pipeline-model-parallel-size (1)",
    ),
    (
        ["--tensor-model-parallel-size", "3"],
        3,
        "--num-attention-heads (4) is not divisible by --tensor-model-parallel-size (3)",
    ),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 2, "launch a multiple of 4 ranks"),
    (
        ["--global-batch-size", "6"],
        4,
        "--global-batch-size (6) must be a multiple of --micro-batch-size (2) x data-parallel size (4) = 8",
    ),
    (
        ["--ffn-hidden-size", "30", "--tensor-model-parallel-size", "4"],
        4,
        "--ffn-hidden-size (30) is not divisible by --tensor-model-parallel-size (4)",
    ),
    (
        ["--pipeline-model-parallel-size", "3"],
        3,
        "--num-layers (4) must be divisible by --pipeline-model-parallel-size (3)",
    ),
    (
        ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "4"],
        2,
        "must split evenly over the other 1 pipeline ranks, at least one layer each",
    ),
    (["--decoder-last-pipeline-num-layers", "1"], 1, "need --pipeline-model-parallel-size > 1"),
    (
        [
            "--pipeline-model-parallel-size",
            "2",
            "--decoder-first-pipeline-num-layers",
            "3",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
        ],
        2,
        "use --num-virtual-stages-per-pipeline-rank",
    ),
    (
        [
            "--pipeline-model-parallel-size",
            "2",
            "--decoder-first-pipeline-num-layers",
            "3",
            "--num-virtual-stages-per-pipeline-rank",
            "2",
        ],
        2,
        "pipeline rank 0 holds 3 layers, not divisible by 2 virtual",
    ),
    (["--context-parallel-size", "3"], 3, "--seq-length (16) must be divisible by 2 x --context-parallel-size (3) = 6"),
    (
        [
            "--context-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "4",
            "--sequence-parallel",
            "--attention-dropout",
            "0",
            "--seq-length",
            "24",
        ],
        8,
        "x --tensor-model-parallel-size (4) under --sequence-parallel = 16",
    ),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"], 2, "not supported with --context-parallel-size 2"),
    (
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
        2,
        "must be a multiple of --num-layers-per-virtual-pipeline-stage (3)",
    ),
    (
        ["--num-layers-per-virtual-pipeline-stage", "1"],
        1,
        "virtual pipeline stages need --pipeline-model-parallel-size > 1",
    ),
    (["--data-path", "x"], 1, "give either --mock-data or --data-path/--train-data-path, not both"),
    (["--num-query-groups", "2"], 1, "--num-query-groups needs --group-query-attention"),
    (
        ["--group-query-attention", "--num-query-groups", "3"],
        1,
        "--num-attention-heads (4) must be divisible by --num-query-groups (3)",
    ),
    (["--bf16", "--fp16"], 1, "mutually exclusive"),
    (
        ["--lr-decay-style", "linear", "--lr-warmup-iters", "5", "--lr-decay-iters", "5"],
        1,
        "the decay (10 samples, --lr-decay-iters/-samples, default the training length) "
        "must exceed the warm-up (10 samples)",
    ),
    (["--recompute-granularity", "full"], 1, "--recompute-granularity full needs --recompute-method"),
    (["--recompute-method", "block"], 1, "--recompute-method only applies with --recompute-granularity full"),
    (["--min-lr", "1", "--lr", "0.1"], 1, "need 0 <= --min-lr"),
    (["--hidden-dropout", "1.5"], 1, "--hidden-dropout must be in [0, 1)"),
    (["--bogus-flag"], 1, "unrecognized arguments: --bogus-flag"),
    (["--normalization", "BatchNorm"], 1, "invalid choice: 'BatchNorm'"),
    (["--device-memory-gb", "0"], 1, "--device-memory-gb must be > 0"),
    (["--host-memory-gb", "-1"], 1, "--host-memory-gb must be > 0, got -1.0"),
    (["--vocab-size", "1"], 1, "--mock-data needs --vocab-size >= 2, got 1"),
    (["--init-method-std", "0"], 1, "--init-method-std must be > 0"),
    (
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "15"],
        2,
        "--seq-length (15) must be divisible by --tensor-model-parallel-size (2) with --sequence-parallel",
    ),
    (
        ["--data-parallel-sharding-strategy", "optim_grads"],
        2,
        "--data-parallel-sharding-strategy needs --use-megatron-fsdp",
    ),
    (
        ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "no_shard", "--use-distributed-optimizer"],
        2,
        "use --data-parallel-sharding-strategy optim (or a stronger one), not no_shard",
    ),
    (
        ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-param-gather"],
        2,
        "--overlap-param-gather applies to the optim and optim_grads strategies",
    ),
    (
        ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads", "--no-overlap-grad-reduce"],
        2,
        "reduce-scatters each bucket as backward completes it: drop --no-overlap-grad-reduce",
    ),
    (
        ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "no_shard", "--optimizer-cpu-offload"],
        2,
        "--optimizer-cpu-offload needs --use-distributed-optimizer",
    ),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "zero3"], 2, "invalid choice: 'zero3'"),
    (
        ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads", "--reshard-params-after-forward"],
        2,
        "--reshard-params-after-forward applies to --data-parallel-sharding-strategy optim_grads_params only",
    ),
]


@pytest.mark.parametrize("extra,world,message", ERRORS, ids=[m[:40] for _, _, m in ERRORS])
def test_error_message(extra, world, message):
    with pytest.raises(ValueError) as info:
        parse(extra, world)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_gqa_tensor_parallel_must_divide_groups():
    with pytest.raises(
        ValueError,
        match=r"--num-query-groups \(2\) is not divisible by --tensor-model-parallel-size \(4\) "
        r"\(each tp rank holds whole key/value groups",
    ):
        parse(
            [
                "--num-attention-heads",
                "8",
                "--group-query-attention",
                "--num-query-groups",
                "2",
                "--tensor-model-parallel-size",
                "4",
            ],
            world_size=4,
            defaults=LLAMA_DEFAULTS,
        )


def test_defaults_and_derived_values():
    run = parse(["--tensor-model-parallel-size", "2", "--global-batch-size", "16"], world_size=4)
    assert (run.parallel.tp, run.parallel.dp, run.training.num_microbatches) == (2, 2, 4)
    assert run.model.padded_vocab_size == 256 and run.model.normalization == "LayerNorm"
    llama = parse([], defaults=LLAMA_DEFAULTS)
    assert llama.model.swiglu and not llama.model.add_bias_linear and llama.model.untie_embeddings_and_output_weights
    assert llama.model.normalization == "RMSNorm" and llama.model.position_embedding_type == "rope"


def test_gradient_accumulation_fusion_is_a_real_switch_for_every_dtype():
    def fusion_notes(extra):
        run = parse(extra + ["--lr", "1e-4"])
        return run.model.gradient_accumulation_fusion, run.notes

    assert fusion_notes([]) == (True, [])
    assert fusion_notes(["--no-gradient-accumulation-fusion"]) == (False, [])  # a real flag, not a noted no-op
    assert fusion_notes(["--bf16"]) == (True, [])  # bf16 products summed in the fp32 main_grad
    assert fusion_notes(["--bf16", "--no-gradient-accumulation-fusion"]) == (False, [])


def test_cross_entropy_fusion_is_a_real_switch_and_te_runs_ours_noted():
    def fusion(extra):
        run = parse(extra + ["--lr", "1e-4"])
        paths = startup_kernel_paths(run.model, torch.device("cpu"))
        return run.model.cross_entropy_loss_fusion, paths["lm head + cross entropy"], run.notes

    assert fusion([]) == (False, "unfused", [])
    fused = "fused, torch (tensors on CPU)"
    assert fusion(["--cross-entropy-loss-fusion"]) == (True, fused, [])
    assert fusion(["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"]) == (True, fused, [])
    on, path, notes = fusion(["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"])
    assert (on, path) == (True, fused) and len(notes) == 1 and "Transformer Engine is not used here" in notes[0]
    assert fusion(["--cross-entropy-fusion-impl", "te"])[1:] == (
        "unfused",
        ["> note: --cross-entropy-fusion-impl te changes nothing without --cross-entropy-loss-fusion"],
    )


def test_sequence_parallel_without_tp_is_noted_not_applied():
    run = parse(["--sequence-parallel"])
    assert run.sequence_parallel_requested and not run.model.sequence_parallel


def test_cli_prints_one_error_line_and_exits_2():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py")] + TINY + ["--global-batch-size", "3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --global-batch-size (3) must be a multiple of --micro-batch-size (2) x data-parallel size (1) = 2"
    ]


def test_cli_refuses_nccl_without_cuda():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py")] + TINY + ["--distributed-backend", "nccl"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --distributed-backend nccl needs CUDA devices; use gloo on CPU"]


def test_cli_refuses_a_job_that_does_not_fit_unless_told():
    small = TINY + ["--device-memory-gb", "0.001"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py")] + small, capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("error: the certain part of the memory estimate")
        and "--skip-memory-check" in lines[0]
    )
    forced = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py")] + small + ["--skip-memory-check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert forced.returncode == 0 and "iteration        2/       2" in forced.stdout


def test_megatron_defaults_for_swiglu_ffn_and_query_groups():
    """--swiglu without --ffn-hidden-size gives int(8h/3 / 64) * 64; --group-query-attention
    without --num-query-groups gives one group (Megatron's defaults)."""
    llama = parse(
        ["--hidden-size", "256", "--num-attention-heads", "8", "--group-query-attention"], defaults=LLAMA_DEFAULTS
    ).model
    assert llama.ffn_hidden_size == int(8 * 256 / 3 / 64) * 64 == 640
    assert llama.num_query_groups == 1
    gpt = parse([]).model
    assert gpt.ffn_hidden_size == 4 * 32 and gpt.num_query_groups == 4


def test_mock_data_with_a_tokenizer_takes_its_vocabulary():
    """As Megatron-LM: --mock-data with --tokenizer-type builds the tokenizer (NullTokenizer: --vocab-size + 1)."""
    assert parse([]).model.vocab_size == 100
    assert parse(["--tokenizer-type", "NullTokenizer"]).model.vocab_size == 101
    spm = str(Path(__file__).resolve().parents[2] / "data" / "tokenizers" / "spm" / "tokenizer.model")
    llama2 = parse(["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", spm])
    assert llama2.model.vocab_size == sentencepiece.SentencePieceProcessor(model_file=spm).vocab_size()
