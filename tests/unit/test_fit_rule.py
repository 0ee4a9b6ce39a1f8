"""The fit rule (megatron/planning/fit_rule.py): one verdict per layout and device, its boundaries,
and the allowances it keeps as margin (NCCL buffers per communicator, the document mask)."""

import dataclasses

import pytest

from megatron.planning import estimate_memory, fit_verdict
from megatron.planning.budget import GIB
from megatron.planning.communicators import communicators
from megatron.planning.fit_rule import DOES_NOT_FIT, FITS, MARGIN
from megatron.planning.hardware import DEVICES
from megatron.planning.startup_check import check_estimate, explain
from megatron.planning.transients import NCCL_COMMUNICATOR_BYTES
from megatron.training.arguments.tool_command_line import run_config_for_tool
from megatron.training.memory_check import layout_from_run

LLAMA31_8B = (
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --vocab-size 128256 --bf16 --seq-length 8192 --global-batch-size 64"
)
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
PRESETS = ("a100-40gb", "a100-80gb", "h100-80gb", "h800", "h100-nvl", "h200", "b200", "gb200")

# Llama-3.1-8B layouts (GPUs, flags) and their verdict on each preset, in PRESETS' order (memory GiB:
# 39.39, 79.15, 79.11, 79.11, 93.6, 139.7, 178, 184). Why each, from the estimate's parts:
LAYOUTS = {
    # one GPU, replicated optimizer: 18 bytes x 8.03e9 parameters = 134.6 GiB of model states, certain
    # 140.66 GiB with the activations: refused up to H200 (139.7 GiB, by about 1 GiB), and its
    # total 148.7 GiB fits B200 and GB200
    "1 GPU replicated, full recompute": (1, f"--micro-batch-size 1 {FULL}", "DDDDDDFF"),
    # the same at seq 4096: certain 137.6 GiB fits H200, the total 142.2 GiB does not: a margin, and
    # a negative one (the logits temporary, derived, already overflows before any allowance)
    "1 GPU replicated, full recompute, seq 4096": (
        1,
        f"--seq-length 4096 --micro-batch-size 1 {FULL}",
        "DDDDDMFF",
    ),
    # the layout Megatron-LM trained on H100 94 GB: certain 71.73 GiB is below A100 80 GB's 79.15 (on
    # the 80 GB parts only the allowances can make it fail: a margin) and fits 93.6 GiB with its total
    # (84.64 GiB; 78.98 and 92.61 GiB before the SwiGLU kernel of issue 43 stopped keeping silu(gate))
    "tp 2 + SP, distributed optimizer, micro batch 2": (
        8,
        "--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --micro-batch-size 2",
        "DMMMFFFF",
    ),
    # certain 60.5 GiB, total 73.6 GiB: fits everything but A100 40 GB (before the SwiGLU kernel of
    # issue 43: certain 68.0, total 81.8 GiB, a margin on the 80 GB parts)
    "tp 4 + SP, distributed optimizer, micro batch 4": (
        8,
        "--tensor-model-parallel-size 4 --sequence-parallel --use-distributed-optimizer --micro-batch-size 4",
        "DFFFFFFF",
    ),
    # total 26.5 GiB: fits everything
    "tp 8 + SP, distributed optimizer, micro batch 1": (
        8,
        "--tensor-model-parallel-size 8 --sequence-parallel --use-distributed-optimizer --micro-batch-size 1",
        "FFFFFFFF",
    ),
}
KINDS = {"F": FITS, "M": MARGIN, "D": DOES_NOT_FIT}


def _run(gpus: int, flags: str):
    return run_config_for_tool(f"{LLAMA31_8B} {flags}".split(), "llama", gpus, "test")


def _estimate(gpus: int, flags: str, device_type: str = "cuda"):
    run = _run(gpus, flags)
    return estimate_memory(run.model, layout_from_run(run, device_type))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_verdict_on_every_preset(name):
    gpus, flags, expected = LAYOUTS[name]
    estimate = _estimate(gpus, flags)
    for preset, kind in zip(PRESETS, expected, strict=True):
        device_bytes = int(DEVICES[preset].memory_gib * GIB)
        verdict = fit_verdict(estimate, device_bytes)
        assert verdict.kind == KINDS[kind], (name, preset, verdict.describe())
        assert estimate.fits(device_bytes) == verdict.fits
        assert estimate.would_refuse(device_bytes) == verdict.refused
        line = check_estimate(estimate, device_bytes, skip=True)
        if verdict.kind == MARGIN:
            assert line.startswith("> WARNING: fits with margin") and "may run out of memory" in line
        assert ("device memory: fits: pipeline rank" in line) == verdict.fits


def test_boundaries_to_the_byte():
    """fits: the full estimate equals the device at most; one byte more leaves a margin (the room
    the allocator-visible peak leaves, one byte less than the allowances); down to the certain part
    itself still a margin (it starts); one byte less than the certain part does not fit."""
    estimate = _estimate(8, "--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 1")
    rank = estimate.worst_rank
    total, certain = rank.total_bytes, rank.certain_bytes
    allowances = sum(rank.uncertain().values())
    assert fit_verdict(estimate, total).kind == FITS
    below = fit_verdict(estimate, total - 1)
    assert below.kind == MARGIN and below.margin_bytes == allowances - 1 and below.allowance_bytes == allowances
    assert below.visible_bytes + below.allowance_bytes == total
    assert fit_verdict(estimate, certain).kind == MARGIN
    assert fit_verdict(estimate, certain - 1).kind == DOES_NOT_FIT
    assert fit_verdict(estimate, certain - 1).label == "does not fit"
    assert below.label == f"fits with margin {(allowances - 1) / GIB:.2f} GiB"


def test_pipeline_ranks_decide_by_the_worst():
    """Under pp the verdict is the worst rank's: the first stage (embedding, most microbatches in
    flight) refuses before the last; a device between their certain parts refuses on rank 0."""
    estimate = _estimate(8, "--pipeline-model-parallel-size 4 --micro-batch-size 1")
    certain = sorted(r.certain_bytes for r in estimate.ranks)
    verdict = fit_verdict(estimate, (certain[-1] + certain[-2]) // 2)
    assert verdict.kind == DOES_NOT_FIT
    assert verdict.certain_bytes == certain[-1] == estimate.worst_certain_rank.certain_bytes


def test_nccl_buffers_per_communicator_by_name():
    """Each communicator a rank runs collectives on adds NCCL_COMMUNICATOR_BYTES on CUDA, none on CPU
    (gloo); the embedding group only on the end stages of a tied model; named in --explain."""
    flags = "--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --micro-batch-size 1"
    cuda = _estimate(8, flags)
    for rank in cuda.ranks:
        names = rank.transients.communicators
        assert names == ("world", "tp", "dp x cp", "pp")  # untied: no embedding group
        assert rank.transients.communicator_bytes == 4 * NCCL_COMMUNICATOR_BYTES
        assert "NCCL buffers (world, tp, dp x cp, pp)" in rank.uncertain()
    lines = "\n".join(explain(cuda))
    assert "allowance  NCCL buffers (world, tp, dp x cp, pp)" in lines
    cpu = _estimate(8, flags, "cpu")
    assert all(r.transients.communicator_bytes == 0 and not r.uncertain() for r in cpu.ranks)
    run = _run(8, flags)
    layout = layout_from_run(run, "cuda")
    tied = dataclasses.replace(run.model, untie_embeddings_and_output_weights=False)
    assert communicators(tied, layout, 0) == ("world", "tp", "dp x cp", "pp", "embedding")
    assert communicators(run.model, layout, 0) == ("world", "tp", "dp x cp", "pp")
    one = _run(1, "--micro-batch-size 1")
    assert communicators(one.model, layout_from_run(one, "cuda"), 0) == ()


def test_document_mask_is_an_allowance_by_name():
    """--reset-attention-mask: the model builds a [b, 1, s, s] bool mask per microbatch; b s^2 bytes
    per microbatch-chunk in flight, in the uncertain part, named in --explain."""
    run = _run(8, "--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 2 --attention-backend torch")
    layout = layout_from_run(run, "cuda")
    plain = estimate_memory(run.model, layout)
    masked = estimate_memory(run.model, dataclasses.replace(layout, document_mask=True))
    rank = masked.worst_rank
    assert plain.worst_rank.transients.mask_bytes == 0 and "document mask" not in str(plain.worst_rank.uncertain())
    assert rank.transients.mask_bytes == 2 * 8192 * 8192 * rank.peak_microbatches
    assert rank.uncertain()["document mask (--reset-attention-mask)"] == rank.transients.mask_bytes
    assert rank.certain_bytes == plain.worst_rank.certain_bytes and rank.total_bytes > plain.worst_rank.total_bytes
    assert "allowance  document mask (--reset-attention-mask)" in "\n".join(explain(masked))
