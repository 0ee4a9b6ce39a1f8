"""The iteration line parses like Megatron's; the FLOPs count matches a hand computation."""

from __future__ import annotations

import re
import sys

from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.flops import flops_per_iteration
from megatron.training.log import IntervalTotals, TensorBoardWriter, format_iteration_line

MEGATRON_LINE = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \| "
    r"elapsed time per iteration \(ms\): ([\d.]+) \| throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \| "
    r"learning rate: (\d\.\d{6}E[+-]\d\d) \| global batch size: +(\d+) \| lm loss: (\d\.\d{6}E[+-]\d\d) \| "
    r"loss scale: ([\d.]+) \| grad norm: ([\d.]+) \| number of skipped iterations: +(\d+) \| "
    r"number of nan iterations: +(\d+) \|$"
)


def test_iteration_line_format():
    line = format_iteration_line(
        iteration=7,
        train_iters=100,
        consumed_samples=56,
        elapsed_ms=12.34,
        tflops_per_gpu=1.25,
        lr=3e-4,
        global_batch_size=8,
        lm_loss=5.5234567,
        loss_scale=65536.0,
        grad_norm=1.23456,
        skipped=1,
        nan=0,
    )
    match = MEGATRON_LINE.match(line)
    assert match, line
    assert match.groups()[:4] == ("7", "100", "56", "12.3") and match.group(8) == "5.523457E+00"
    assert match.group(6) == "3.000000E-04" and match.group(10) == "1.235"


def test_interval_counts_skipped_and_nan_iterations():
    """As Megatron: the loss averages only iterations that updated (a skipped iteration's finite
    loss is left out too); a skipped iteration counts as nan only when its loss is not finite."""
    totals = IntervalTotals()
    totals.add(5.0, 0.1, skipped=False, idle=0.0)
    totals.add(float("nan"), 0.1, skipped=True, idle=0.0)
    totals.add(4.0, 0.1, skipped=True, idle=0.0)
    assert (totals.skipped, totals.nan, totals.loss_count, totals.loss) == (2, 1, 1, 5.0)


def test_flops_hand_computed():
    config = TransformerConfig(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        num_query_groups=1,
        vocab_size=100,
        seq_length=4,
        ffn_hidden_size=16,
        swiglu=True,
        make_vocab_size_divisible_by=64,
    )
    # per layer: qkv 8*(2+2)*4=128, proj 2*4*8=64, attention 2*4*2*4=64, mlp 3*8*16=384 -> 640
    # per token: 2*(2*640 + 8*128) = 4608; iteration: 3 * 4608 * 4 tokens * 3 sequences
    assert flops_per_iteration(config, global_batch_size=3) == 3 * 4608 * 4 * 3


def test_tensorboard_missing_is_said_not_silent(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    writer = TensorBoardWriter(str(tmp_path), enabled=True)
    assert writer.writer is None
    assert "tensorboard is not installed" in capsys.readouterr().err
