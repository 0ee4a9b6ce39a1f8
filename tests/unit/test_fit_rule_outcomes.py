"""The fit rule on published outcomes (tools/bench/fit_rule_outcomes.py): BigScience's BLOOM-176B layout
search on 384 A100 80 GB (tools/bench/published_runs.py, `BIGSCIENCE_RUNS`), rows that trained and rows
that ran out of memory, and out-of-memory reports of Megatron-LM itself (`MEGATRON_LM_RUNS`). Each row's
verdict is pinned, and the 80% rule's (before issue 36), with why."""

import pytest

from megatron.planning.budget import GIB
from megatron.planning.estimator import estimate_memory
from megatron.planning.fit_rule import DOES_NOT_FIT, FITS, MARGIN
from megatron.training.arguments.tool_command_line import run_config_for_tool
from tools.bench.fit_rule_outcomes import kept, memory_run_layout
from tools.bench.published_runs import BIGSCIENCE_RUNS, MEGATRON_LM_RUNS, MEMORY_RUNS

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

# name -> (our verdict, kept by the 80% rule). Every row that trained "fits" (totals 28.5-62.2 GiB of
# 79.15) and is kept by both rules. The chronicle's measured memory (nvidia-smi) is above our totals on
# every row that reports one: by 3-14 GB on 02-25 (fp16, DeepSpeed ZeRO-1), by 17-22 GB (about 5 bytes
# per parameter of the rank) on 02-28 (DeepSpeed's then new BF16 optimizer), so on 02-28 the estimate of
# our trainer on that layout is no estimate of Megatron-DeepSpeed's memory, and the out-of-memory rows
# of that day fit by our estimate.
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
    # GiB margin is less than the allowances (4.3 GiB: fragmentation, NCCL buffers, runtime); 80% rule: 97%
    "BigSci 02-25 L72/h14336/a64 32x2x6 m1 g2048": ("M", False),
    # 02-25, NHIDDEN=12288 / NLAYERS=96, tp 1 x pp 48: trained
    "BigSci 02-25 L96/h12288/a64 8x1x48 m1 g2048": ("F", True),
    # 02-28, bf16 with fp32 gradients, the embedding in a layer slot: trained
    **{f"BigSci 02-28 {row}": ("F", True) for row in RAN_0228},
    # out of memory, kept by ours (wrongly): 8.02e9 parameters a rank, total 66.0 GiB; the 80% rule drops
    # it by a hair (total 63.5 GiB, 80.2%). At the 02-28 rows' measured excess of about 5 bytes per
    # parameter it would need about 100 GB
    "BigSci 02-28 L100/h12288/a64 16x4x6 m2 g2048": ("F", False),
    # out of memory, kept by both (wrongly): micro batch 1 of the same, total 60.8 GiB (80% rule: 74%)
    "BigSci 02-28 L100/h12288/a64 16x4x6 m1 g2048": ("F", True),
    # out of memory, kept by both (wrongly): total 47.7 GiB (80% rule: 57%); its neighbour with 70 layers
    # (one fewer a stage) trained at a measured 60 GB, so even the measured excess leaves about 10 GB that
    # neither the estimate nor the chronicle explains
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
    args = run_config_for_tool(list(run.flags), run.family, run.num_gpus, "test")
    return args, estimate_memory(args.model, memory_run_layout(run, args))


def test_every_row_is_pinned():
    assert sorted(EXPECTED) == sorted(run.name for run in BIGSCIENCE_RUNS)
    assert sum(run.oom for run in BIGSCIENCE_RUNS) == 6 and len(BIGSCIENCE_RUNS) == 44
    assert sorted(EXPECTED_MEGATRON_LM) == sorted(run.name for run in MEGATRON_LM_RUNS)
    assert all(run.oom for run in MEGATRON_LM_RUNS)


@pytest.mark.parametrize("run", BIGSCIENCE_RUNS + MEGATRON_LM_RUNS, ids=lambda run: run.name)
def test_verdict_of_each_row(run):
    args = run_config_for_tool(list(run.flags), run.family, run.num_gpus, "test")
    device_bytes = int(run.device_memory_gib * GIB)
    before, after, total_gib, label = kept(args.model, memory_run_layout(run, args), device_bytes)
    kind, kept_before = PINNED[run.name]
    assert label.startswith(KINDS[kind]) and after == (kind == "F"), (run.name, label, total_gib)
    assert before == kept_before, (run.name, total_gib)
    if run.measured_gb is not None:  # the estimate is below what the chronicle measured, on every row
        assert total_gib < run.measured_gb


def test_outcome_counts():
    """Of the 38 rows that trained neither rule drops one; of the 6 that ran out of memory ours keeps 3,
    the 80% rule 2 (the numbers in docs/memory.md)."""
    ran = [run.name for run in BIGSCIENCE_RUNS if not run.oom]
    oom = [run.name for run in BIGSCIENCE_RUNS if run.oom]
    assert len(ran) == 38 and all(EXPECTED[name] == ("F", True) for name in ran)
    assert sum(EXPECTED[name][0] == "F" for name in oom) == 3
    assert sum(EXPECTED[name][1] for name in oom) == 2


def test_outcome_counts_of_every_out_of_memory_row():
    """All sources: 7 layouts ran out of memory; ours keeps 3 (43%), the 80% rule 2 (docs/memory.md)."""
    oom = [run.name for run in MEMORY_RUNS if run.oom]
    assert len(oom) == 7
    assert sum(PINNED[name][0] == "F" for name in oom) == 3
    assert sum(PINNED[name][1] for name in oom) == 2


def test_megatron_lm_525_against_its_log():
    """The report's own numbers: the log counts 771,201,024 parameters; when the first forward failed, PyTorch
    had 28.82 GiB allocated. Our counterpart at that moment (weights, fp16 gradient buffer, fp32 main
    parameters, saved activations; Adam's moments come with the first optimizer step) is 28.23 GiB."""
    (run,) = [r for r in MEGATRON_LM_RUNS if r.name.startswith("Megatron-LM #525")]
    _, estimate = _estimate(run)
    (rank,) = estimate.ranks
    assert rank.parameters == 771_201_024
    main_params = 4 * rank.parameters  # the distributed optimizer's fp32 copy (dp 1: the whole model)
    at_failure = rank.weights_bytes + rank.grads_bytes + main_params + rank.activations_bytes
    assert 27.8 * GIB < at_failure < 28.82 * GIB
