"""Learning-rate and batch-size schedules against Megatron's formulas, computed by hand here,
and the flags that build them (sample- and iteration-based, fractions, WSD, decoupled lr)."""

from __future__ import annotations

import math

import pytest

from megatron.core.optimizer.lr_schedule import LRSchedule
from megatron.training.arguments.parser import GPT_DEFAULTS, parse_run_config
from megatron.training.batch_schedule import BatchSizeSchedule, parse_step_schedule

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
    "--mock-data",
    "--vocab-size",
    "100",
    "--lr",
    "1.0",
    "--min-lr",
    "0.1",
]


def run(extra, world_size=1):
    return parse_run_config(TINY + extra, GPT_DEFAULTS, world_size)


def test_sample_based_warmup_and_cosine_decay():
    """--train-samples 100 --lr-warmup-samples 10 --lr-decay-samples 90 --lr-warmup-init 0.2."""
    r = run(
        [
            "--train-samples",
            "100",
            "--global-batch-size",
            "4",
            "--lr-warmup-samples",
            "10",
            "--lr-decay-samples",
            "90",
            "--lr-decay-style",
            "cosine",
            "--lr-warmup-init",
            "0.2",
        ]
    )
    s = r.lr_schedule
    assert r.training.train_iters == 25  # 100 // 4, as Megatron rounds
    assert s(0) == pytest.approx(0.2) and s(5) == pytest.approx(0.2 + 0.8 * 5 / 10)
    assert s(50) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 40 / 80)))
    assert s(90) == pytest.approx(0.1) and s(91) == 0.1


def test_iteration_flags_count_in_samples_and_warmup_fraction():
    r = run(["--train-iters", "10", "--global-batch-size", "4", "--lr-warmup-fraction", "0.25"])
    s = r.lr_schedule
    assert (s.decay_steps, s.warmup_steps) == (40, 10.0)  # decay 10 iterations x 4; warm-up 25% of it
    assert s(4) == pytest.approx(0.4) and s(25) == pytest.approx(0.1 + 0.9 * (1 - 15 / 30))


def test_inverse_square_root():
    s = LRSchedule(max_lr=1.0, min_lr=0.1, style="inverse-square-root", warmup_steps=4, decay_steps=1000)
    assert s(2) == 0.5 and s(16) == pytest.approx(math.sqrt(4) / math.sqrt(16)) and s(10000) == 0.1
    assert s(900) == pytest.approx(max(0.1, 2 / 30))


@pytest.mark.parametrize(
    "style,q_coeff",
    [
        ("linear", lambda q: 1 - q),
        ("cosine", lambda q: (1 + math.cos(math.pi * q)) / 2),
        ("exponential", lambda q: 2 * 0.5**q - 1),
        ("minus_sqrt", lambda q: 1 - math.sqrt(q)),
    ],
)
def test_wsd(style, q_coeff):
    """--lr-decay-style WSD: flat until the last --lr-wsd-decay-iters x G samples, then the style."""
    r = run(
        [
            "--train-iters",
            "20",
            "--global-batch-size",
            "2",
            "--lr-decay-style",
            "WSD",
            "--lr-wsd-decay-style",
            style,
            "--lr-wsd-decay-iters",
            "5",
            "--lr-warmup-iters",
            "2",
        ]
    )
    s = r.lr_schedule
    assert (s.decay_steps, s.wsd_decay_steps, s.warmup_steps) == (40, 10, 4)
    assert s(2) == pytest.approx(0.5) and s(20) == 1.0 and s(30) == 1.0
    for n in (33, 36, 40):
        assert s(n) == pytest.approx(0.1 + 0.9 * q_coeff((n - 30) / 10))


def test_decoupled_lr_follows_the_same_timing():
    r = run(["--train-iters", "10", "--lr-warmup-iters", "2", "--decoupled-lr", "3.0", "--decoupled-min-lr", "0.3"])
    d = r.decoupled_lr_schedule
    assert d(2) == pytest.approx(1.5) and d(20) == pytest.approx(0.3) and r.lr_schedule(2) == pytest.approx(0.5)
    assert run(["--train-iters", "10", "--decoupled-lr", "3.0"]).decoupled_lr_schedule.min_lr == 0.1


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--train-iters", "10", "--lr-decay-samples", "5"], "--lr-decay-samples cannot be used with --train-iters"),
        (["--train-samples", "40", "--lr-warmup-iters", "1"], "--lr-warmup-iters cannot be used with --train-samples"),
        (
            ["--train-iters", "10", "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "1"],
            "only one of --lr-warmup-fraction",
        ),
        (["--train-iters", "10", "--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
        ([], "give exactly one of --train-iters and --train-samples"),
        (["--train-iters", "10", "--decoupled-min-lr", "0.1"], "--decoupled-min-lr needs --decoupled-lr"),
        (["--train-iters", "10", "--lr-warmup-init", "2"], "--lr-warmup-init (2.0) <= --lr (1.0)"),
    ],
)
def test_schedule_flag_errors(extra, message):
    with pytest.raises(ValueError) as info:
        run(extra)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_rampup_batch_size_hand_computed():
    """--rampup-batch-size 4 4 40 to G 16: 3 increments, one every 40/3 samples."""
    s = BatchSizeSchedule(16, rampup=(4, 4, 40))
    assert [s.at(c) for c in (0, 13, 14, 27, 40, 41)] == [4, 4, 8, 12, 16, 16]
    consumed = [s.consumed_before(i) for i in range(1, 9)]
    assert consumed == [0, 4, 8, 12, 16, 24, 32, 44]  # 4,4,4,4 (<= 13.3), 8, 8, 12 (>= 26.7), 16 (> 40)
    # Megatron's count: ramp iterations while consumed <= 40 (7, reaching 44), then whole G batches
    assert s.iterations_for(100) == 7 + (100 - 44) // 16


def test_step_batch_size_schedule_thresholds_in_tokens():
    steps = parse_step_schedule("0:16 2.4K:32 4.8K:48", seq_length=16)
    assert steps == ((0, 16), (150, 32), (300, 48))
    s = BatchSizeSchedule(48, steps=steps)
    assert [s.at(c) for c in (0, 149, 150, 300)] == [16, 16, 32, 48]
    assert s.iterations_for(160) == 10  # batches of 16 until 160 samples are reached
    with pytest.raises(ValueError, match="must start with a threshold of 0"):
        parse_step_schedule("10:16", 1)


def test_batch_schedule_flags():
    r = run(["--train-iters", "5", "--rampup-batch-size", "2", "2", "8", "--global-batch-size", "6"], world_size=1)
    assert r.training.batch_schedule.sizes() == [2, 4, 6] and r.training.global_batch_size == 6
    with pytest.raises(ValueError, match=r"every batch size of the schedule, here \(2\) must be a multiple"):
        run(["--train-iters", "5", "--rampup-batch-size", "2", "2", "8", "--global-batch-size", "8"], world_size=4)
    with pytest.raises(ValueError, match=r"must equal the last batch size of --step-batch-size-schedule \(4\)"):
        run(["--train-iters", "5", "--step-batch-size-schedule", "0:2 64:4", "--global-batch-size", "8"])
