"""The fit rule on published outcomes (tools/bench/fit_rule_outcomes.py): BigScience's BLOOM-176B layout
search on 384 A100 80 GB (tools/bench/published_memory_outcomes.py, `BIGSCIENCE_RUNS`), rows that trained and rows
that ran out of memory, out-of-memory reports of Megatron-LM itself (`MEGATRON_LM_RUNS`), and Fujii et al.'s 4D
sweep of Llama-3.1-8B with Megatron-LM on A100 40 GB and H100 94 GB (`FUJII_RUNS`, issue 41 item 5). Each row's
verdict is pinned, and the 80% rule's (before issue 36), with why. The rows of 02-28 count what DeepSpeed's
BF16_Optimizer holds beyond our estimate (`DEEPSPEED_BF16_OPTIMIZER`: 2 bytes a parameter of the rank)."""

import pytest

from megatron.planning.budget import GIB
from megatron.planning.estimator import estimate_memory
from megatron.planning.fit_rule import DOES_NOT_FIT, FITS, MARGIN
from tools.bench.fit_rule_outcomes import kept, memory_run_model_and_layout, with_optimizer
from tools.bench.published_memory_outcomes import (
    BIGSCIENCE_RUNS,
    DEEPSPEED_BF16_OPTIMIZER,
    FUJII_RUNS,
    MEGATRON_LM_RUNS,
    MEMORY_RUNS,
)

KINDS = {"F": FITS, "M": MARGIN, "D": DOES_NOT_FIT}

# the rows that trained, by date
RAN_0225 = (
    "8x8x6 m4 g1568", "8x8x6 m4 g2048", "8x8x6 m6 g2016", "4x8x12 m4 g1568", "4x8x12 m4 g2048",
    "4x8x12 m2 g1568", "4x8x12 m2 g2048", "6x8x8 m4 g2016", "12x8x4 m2 g2016", "12x8x4 m4 g2016",
    "24x8x2 m1 g2016", "24x8x2 m2 g2016", "8x4x12 m4 g2048", "8x4x12 m2 g2048", "16x4x6 m4 g2048",
    "16x4x6 m2 g2048", "16x2x12 m2 g2048", "8x2x24 m1 g2048", "8x2x24 m2 g2048", "4x4x24 m1 g2048",
)  # fmt: skip
RAN_0228 = (
    "L106/h12288/a64 8x4x12 m2 g2048", "L106/h12288/a96 8x4x12 m2 g2048", "L106/h12288/a128 8x4x12 m2 g2048",
    "L106/h12288/a96 8x4x12 m4 g2048", "L100/h12288/a64 8x8x6 m2 g2048", "L100/h12288/a64 8x8x6 m4 g2048",
    "L82/h13312/a64 4x8x12 m4 g2048", "L82/h13312/a64 8x4x12 m2 g2048", "L82/h13312/a104 8x4x12 m2 g2048",
    "L82/h13312/a128 8x4x12 m2 g2048", "L82/h13312/a64 8x4x12 m4 g2048", "L94/h13312/a128 8x4x12 m2 g2048",
    "L70/h14336/a64 4x8x12 m2 g2048", "L70/h14336/a64 8x4x12 m2 g2048", "L70/h14336/a112 8x4x12 m2 g2048",
    "L70/h14336/a128 8x4x12 m2 g2048", "L70/h14336/a64 8x4x12 m4 g2048",
)  # fmt: skip

# name -> (our verdict, kept by the 80% rule). Every row that trained "fits" (totals 31.4-70.5 GiB of
# 79.15) and all but one are kept by the 80% rule too. The chronicle's measured memory (nvidia-smi) is above
# our totals on every row that reports one: by 0.6-11.0 GiB on 02-25 (fp16, DeepSpeed's ZeRO-1 optimizer,
# which holds at the activation peak what ours counts). On 02-28 (DeepSpeed's then new BF16_Optimizer) it was
# 7.6-19.0 GiB above our estimate of our trainer; the BF16 optimizer keeps every weight's bf16 gradient beside
# the whole fp32 gradient buffer, 2 bytes a parameter of the rank that ours lacks, and with them counted the
# excess is 3.9-11.6 GiB, about the range of 02-25. (With the runtime allowance of 1 GiB before the measured
# 3.86, each excess was 2.86 GiB larger: 3.4-13.9, 10.5-21.9, 6.8-14.5.)
EXPECTED = {
    # 02-25, fp16, NLAYERS=72, NHIDDEN=14336: trained
    **{f"BigSci 02-25 L72/h14336/a64 {layout}": ("F", True) for layout in RAN_0225},
    # out of memory, dropped by both: tp 8 without pp holds 22.65e9 parameters a rank, 84.4 GiB of fp16
    # weights and gradients alone (certain 94.0 GiB; 80% rule: total 123% of the device)
    "BigSci 02-25 L72/h14336/a64 48x8x1 m1 g2016": ("D", False),
    # out of memory, dropped by both: tp 2 x pp 6 holds 16.6e9 parameters a rank (first stage: 12 layers
    # and the 250k embedding); certain 75.8 GiB, the allocator-visible peak 79.5 GiB is already over
    # 79.15 (a negative margin, -0.36 GiB); 80% rule: 103%
    "BigSci 02-25 L72/h14336/a64 32x2x6 m2 g2048": ("M", False),
    # out of memory, dropped by both: micro batch 1 of the same, certain 71.7, visible 75.2 GiB: the 3.91
    # GiB margin is less than the allowances (7.2 GiB: fragmentation, NCCL buffers, runtime); 80% rule: 97%
    "BigSci 02-25 L72/h14336/a64 32x2x6 m1 g2048": ("M", False),
    # 02-25, NHIDDEN=12288 / NLAYERS=96, tp 1 x pp 48: trained
    "BigSci 02-25 L96/h12288/a64 8x1x48 m1 g2048": ("F", True),
    # 02-28, bf16 with fp32 gradients and DeepSpeed's bf16 gradients, the embedding in a layer slot: trained
    **{f"BigSci 02-28 {row}": ("F", True) for row in RAN_0228},
    # trained at a measured 79 GB, dropped by the 80% rule (wrongly): its total 65.2 GiB (82%), the bf16
    # gradients (8.2 GiB) included; ours: 70.5 GiB, fits
    "BigSci 02-28 L106/h12288/a96 8x4x12 m4 g2048": ("F", False),
    # out of memory, dropped by both: 8.02e9 parameters a rank, certain 74.6 GiB with the bf16 gradients'
    # 14.9 GiB, total 83.8 GiB (margin 2.80 GiB, less than its allowances; 80% rule: 99%); before them
    # ours kept it (66.0)
    "BigSci 02-28 L100/h12288/a64 16x4x6 m2 g2048": ("M", False),
    # out of memory, kept by ours (wrongly): micro batch 1 of the same, total 78.6 GiB, 0.6 GiB under the
    # device; the 02-28 rows that ran measured 3.9-11.6 GiB above their totals. The 80% rule drops it (92%)
    "BigSci 02-28 L100/h12288/a64 16x4x6 m1 g2048": ("F", False),
    # out of memory, kept by both (wrongly): total 59.1 GiB (80% rule: 68%); its neighbour with 70 layers
    # (one fewer a stage) trained at a measured 59-60 GB (total 51.7-52.2), so even that row's excess
    # leaves about 10 GB that neither the estimate nor the chronicle explains
    "BigSci 02-28 L82/h14336/a128 8x4x12 m2 g2048": ("F", True),
}


# Megatron-LM's own out-of-memory reports (name -> (our verdict, kept by the 80% rule))
EXPECTED_MEGATRON_LM = {
    # issue #525, one V100 (31.74 GiB): out of memory in the first forward; dropped by both. Certain 33.98 GiB
    # (fp16 weights and gradients 1.44 GiB each, fp32 main parameters and Adam's moments 8.62, saved
    # activations 22.49 of the unfused attention's s x s scores at micro batch 4), total 38.49 (80% rule: 121%)
    "Megatron-LM #525 GPT 771M V100 m4": ("D", False),
}
PINNED = {**EXPECTED, **EXPECTED_MEGATRON_LM}


def _estimate(run):
    return estimate_memory(*memory_run_model_and_layout(run))


def test_every_row_is_pinned():
    assert sorted(EXPECTED) == sorted(run.name for run in BIGSCIENCE_RUNS) and len(RAN_0228) == 17
    assert sum(run.oom for run in BIGSCIENCE_RUNS) == 6 and len(BIGSCIENCE_RUNS) == 44
    assert sorted(EXPECTED_MEGATRON_LM) == sorted(run.name for run in MEGATRON_LM_RUNS)
    assert all(run.oom for run in MEGATRON_LM_RUNS)


@pytest.mark.parametrize("run", BIGSCIENCE_RUNS + MEGATRON_LM_RUNS, ids=lambda run: run.name)
def test_verdict_of_each_row(run):
    device_bytes = int(run.device_memory_gib * GIB)
    before, after, total_gib, label = kept(*memory_run_model_and_layout(run), device_bytes, run.optimizer)
    kind, kept_before = PINNED[run.name]
    assert label.startswith(KINDS[kind]) and after == (kind == "F"), (run.name, label, total_gib)
    assert before == kept_before, (run.name, total_gib)
    if run.measured_gb is not None:  # the estimate is below what the chronicle measured, on every row
        assert total_gib < run.measured_gb


def test_outcome_counts():
    """Of the 38 rows that trained ours drops none, the 80% rule one; of the 6 that ran out of memory ours
    keeps 2, the 80% rule 1 (the numbers in docs/memory.md)."""
    ran = [run.name for run in BIGSCIENCE_RUNS if not run.oom]
    oom = [run.name for run in BIGSCIENCE_RUNS if run.oom]
    assert len(ran) == 38 and all(EXPECTED[name][0] == "F" for name in ran)
    assert sum(not EXPECTED[name][1] for name in ran) == 1
    assert sum(EXPECTED[name][0] == "F" for name in oom) == 2
    assert sum(EXPECTED[name][1] for name in oom) == 1


def test_outcome_counts_of_every_out_of_memory_row(fujii_verdicts):
    """All sources: 133 layouts ran out of memory (7 pinned above, 124 of Fujii's sweep, 2 of our own trainer on
    one H200, docs/gpu-results/2026-11-28-h200.json): what tools/bench/fit_rule_outcomes.py prints last."""
    oom = [run.name for run in MEMORY_RUNS if run.oom]
    assert len(oom) == 133
    assert [name for name in oom if name.startswith("ours ")] == [
        "ours L22 mbs1 recompute none",
        "ours L24 mbs1 recompute none",
    ]
    pinned = [name for name in oom if name in PINNED]
    assert len(pinned) == 7
    assert sum(PINNED[name][0] == "F" for name in pinned) == 2
    assert sum(PINNED[name][1] for name in pinned) == 1
    fujii = [fujii_verdicts[name] for name in oom if name.startswith("Fujii ")]
    assert len(fujii) == 124
    assert sum(after for _, after, _, _ in fujii) == 5
    assert sum(before for before, _, _, _ in fujii) == 6


# Fujii et al.'s sweep (FUJII_RUNS): 292 layouts, 168 ran and 124 ran out of memory. Each verdict's kind by outcome:
# the three targets read off it (issue 41 item 5): failed layouts called "fits" 5 of 124 (4.0%, target at
# most 2%: missed), layouts that ran called "does not fit" 0 of 168 (target under 10%), "fits with margin" 58 of 292
# (19.9%, target under 20%). Before context parallelism's allowances the issue counted 13 "fits"; after them and
# before issue 43's SwiGLU kernel (which saves only the SwiGLU input, as megatron-core's fused SwiGLU does, and
# lowered every CUDA estimate by 2 s b ffn / tp bytes a layer) 6; after that kernel 10, with the runtime allowance
# of 1 GiB; the measured 3.86 GiB outside the allocator (transients.CUDA_RUNTIME_BYTES) moves 5 of them, and 8 layouts
# that ran, to "fits with margin".
FUJII_KINDS = {("ran", "F"): 158, ("ran", "M"): 10, ("OOM", "F"): 5, ("OOM", "M"): 48, ("OOM", "D"): 71}
# the rows the verdict gets wrong, name -> (total GiB, outcome); docs/memory.md says why no allowance is tuned to them.
FUJII_WRONG = {  # out of memory, "fits" (no layout that ran reads "does not fit" since the SwiGLU kernel)
    # micro batch 4 at tp4 cp2 pp2 fails at every GPU count (its micro batch 2 ran at every count), 1.3-2.4 GiB
    # under the device; at 32 GPUs (36.62 GiB with 1 GiB of runtime allowance) the measured allowance reaches it
    "Fujii a100-40gb s8192 tp4 cp2 pp2 m4 n64": (38.08, "OOM"),
    "Fujii a100-40gb s8192 tp4 cp2 pp2 m4 n128": (37.38, "OOM"),
    "Fujii a100-40gb s8192 tp4 cp2 pp2 m4 n256": (37.03, "OOM"),
    # dp 1 (the optimizer sharded over cp alone), 0.96 GiB under the device; the same layout with dp 2 ran
    "Fujii a100-40gb s8192 tp2 cp4 pp2 m2 n16": (38.43, "OOM"),
    # no estimate on tokens can tell it from a layout that ran: seq 16384 tp4 cp1 pp1 micro batch 2 on the same
    # 4 GPUs has the same tokens a rank and the same total (87.17 GiB; its document mask is twice as large)
    "Fujii h100-94gb s8192 tp4 cp1 pp1 m4 n4": (87.17, "OOM"),
}


@pytest.fixture(scope="module")
def fujii_verdicts():
    """name -> (kept by the 80% rule, kept by ours, total GiB, label) of every row of Fujii et al.'s sweep."""
    return {
        run.name: kept(*memory_run_model_and_layout(run), int(run.device_memory_gib * GIB), run.optimizer)
        for run in FUJII_RUNS
    }


def _kind(label: str) -> str:
    """F, M or D of a verdict's label ("fits with margin X" also starts with "fits")."""
    return next(kind for kind in "MDF" if label.startswith(KINDS[kind]))


def test_fujii_rows_as_published():
    """The table's cells: 99 on A100 40 GB (seq 8192), 92 and 101 on H100 94 GB (seq 8192 and 16384); every
    layout within its GPU count, global batch 1024, the device memory CUDA reports."""
    by_table = {}
    for run in FUJII_RUNS:
        device, seq = run.name.split()[1:3]
        by_table[device, seq] = by_table.get((device, seq), 0) + 1
        assert run.device_memory_gib == {"a100-40gb": 39.39, "h100-94gb": 93.6}[device]
    assert by_table == {("a100-40gb", "s8192"): 99, ("h100-94gb", "s8192"): 92, ("h100-94gb", "s16384"): 101}
    assert sum(run.oom for run in FUJII_RUNS) == 124 and len(FUJII_RUNS) == 292


def test_fujii_outcome_counts(fujii_verdicts):
    """The verdicts' kinds by outcome (FUJII_KINDS) and the 80% rule's: it keeps 6 failed layouts and drops 22
    that ran (13%)."""
    counts = {}
    for run in FUJII_RUNS:
        key = ("OOM" if run.oom else "ran", _kind(fujii_verdicts[run.name][3]))
        counts[key] = counts.get(key, 0) + 1
    assert counts == FUJII_KINDS
    assert sum(fujii_verdicts[run.name][0] for run in FUJII_RUNS if run.oom) == 6
    assert sum(not fujii_verdicts[run.name][0] for run in FUJII_RUNS if not run.oom) == 22


def test_fujii_rows_the_verdict_gets_wrong(fujii_verdicts):
    """Failed layouts called "fits" and layouts that ran called "does not fit": exactly FUJII_WRONG."""
    wrong = {
        run.name: (round(fujii_verdicts[run.name][2], 2), "OOM" if run.oom else "ran")
        for run in FUJII_RUNS
        if _kind(fujii_verdicts[run.name][3]) == ("F" if run.oom else "D")
    }
    assert wrong == FUJII_WRONG


def test_deepspeed_bf16_optimizer_on_the_02_28_rows_only():
    """DeepSpeed's BF16_Optimizer is set on the 17 + 3 rows of 02-28 and on no other row; it adds 2 bytes a
    parameter to every rank's gradients. The chronicle's measured memory minus our total: 7.6-19.0 GiB on
    02-28 without it, 3.9-11.6 with it, against 0.6-11.0 on 02-25 (DeepSpeed's fp16 ZeRO-1: nothing added);
    2.86 GiB less each than with the runtime allowance of 1 GiB (10.5-21.9, 6.8-14.5, 3.4-13.9)."""
    assert {run.name for run in MEMORY_RUNS if run.optimizer is not None} == {
        run.name for run in BIGSCIENCE_RUNS if " 02-28 " in run.name
    }
    assert DEEPSPEED_BF16_OPTIMIZER.extra_grad_bytes_per_parameter == 2
    excess = {"02-25": [], "02-28 without": [], "02-28": []}
    for run in BIGSCIENCE_RUNS:
        estimate = _estimate(run)
        added = with_optimizer(estimate, run.optimizer)
        for ours, theirs in zip(estimate.ranks, added.ranks):
            extra = 0 if run.optimizer is None else 2 * ours.parameters
            assert theirs.grads_bytes == ours.grads_bytes + extra and theirs.total_bytes == ours.total_bytes + extra
        if run.measured_gb is not None:
            date = run.name.split()[1]
            excess[date].append(run.measured_gb - added.max_total_bytes / GIB)
            if date == "02-28":
                excess["02-28 without"].append(run.measured_gb - estimate.max_total_bytes / GIB)
    assert min(excess["02-25"]) > 0.5 and max(excess["02-25"]) < 11.1
    assert min(excess["02-28 without"]) > 7.6 and max(excess["02-28 without"]) < 19.1
    assert min(excess["02-28"]) > 3.8 and max(excess["02-28"]) < 11.7


def test_megatron_lm_525_against_its_log():
    """The report's own numbers: the log counts 771,201,024 parameters; when the first forward failed, PyTorch
    had 28.82 GiB allocated. Our counterpart at that moment (weights, fp16 gradient buffer, fp32 main
    parameters, saved activations; Adam's moments come with the first optimizer step) is 27.30 GiB (28.23
    before our SwiGLU kernel, issue 43, which recomputes silu(gate) in backward instead of keeping it)."""
    (run,) = [r for r in MEGATRON_LM_RUNS if r.name.startswith("Megatron-LM #525")]
    estimate = _estimate(run)
    (rank,) = estimate.ranks
    assert rank.parameters == 771_201_024
    main_params = 4 * rank.parameters  # the distributed optimizer's fp32 copy (dp 1: the whole model)
    at_failure = rank.weights_bytes + rank.grads_bytes + main_params + rank.activations_bytes
    assert 27.2 * GIB < at_failure < 28.82 * GIB
