"""Grouped experts (--moe-grouped-gemm): torch's grouped GEMM with each of its limits handled, against the loop.

The op (megatron/core/transformer/moe/grouped_gemm.py) against one F.linear per expert (float64 reference for the
values): int32 offsets demanded, output and gradients in the input dtype, rows past the last offset zero when asked,
zero weight gradients for experts without rows, dimensions that break the 16-byte stride rule named (and run by the
per-expert fallback, with a start-up note); no bias (MoE layers refuse it). The MoE layer with grouped experts: the
loop's initial weights, canonical checkpoint pieces, output and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core.checkpointing import model_pieces
from megatron.core.tensor_parallel.initialization import expert_tensors, initialize_parameters
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.moe.experts import GroupedExperts, SequentialExperts
from megatron.core.transformer.moe.grouped_gemm import fallback_reason, grouped_linear, looped_linear, offsets_of
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.training.arguments.moe import moe_notes

COUNTS = [5, 0, 7, 4]  # expert 1 gets no rows
ROWS, IN, OUT = sum(COUNTS), 16, 8


def _inputs(dtype, extra_rows: int = 0):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS + extra_rows, IN, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(len(COUNTS), OUT, IN, generator=g) * 0.1).to(dtype).requires_grad_()
    grad = torch.randn(ROWS + extra_rows, OUT, generator=g).to(dtype)
    return x, w, grad


def _run(fn, x, w, grad):
    out = fn(x, w)
    out.backward(grad)
    result = out.detach(), x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    return result


def _float64_loop(x, w, grad, counts):
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    return _run(lambda a, b: looped_linear(a, b, counts), x64, w64, grad.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_matches_one_gemm_per_expert_in_the_input_dtype(dtype):
    x, w, grad = _inputs(dtype)
    grouped = _run(lambda a, b: grouped_linear(a, b, offsets_of(COUNTS, a.device)), x, w, grad)
    looped = _run(lambda a, b: looped_linear(a, b, COUNTS), x, w, grad)
    reference = _float64_loop(x, w, grad, COUNTS)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, mine, loop, exact in zip(("output", "input grad", "weight grad"), grouped, looped, reference):
        assert mine.dtype == dtype, name  # output dtype = input dtype, gradients included
        torch.testing.assert_close(mine.double(), exact, rtol=tol, atol=tol, msg=name)
        torch.testing.assert_close(mine, loop, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("host_counts", [False, True])
def test_experts_without_rows_get_zero_weight_gradients(host_counts):
    """Device offsets alone (every expert's slice masked in place) or the host counts too (the empty experts'
    slices zeroed alone): the same gradients."""
    x, w, grad = _inputs(torch.float32)
    w.grad = None
    grouped_linear(x, w, offsets_of(COUNTS, x.device), counts=COUNTS if host_counts else None).backward(grad)
    assert torch.count_nonzero(w.grad[1]) == 0
    assert all(torch.count_nonzero(w.grad[e]) > 0 for e in (0, 2, 3))


def test_rows_past_the_last_offset_are_zero_when_masked_and_get_no_gradient():
    x, w, grad = _inputs(torch.float32, extra_rows=3)
    offsets = offsets_of(torch.tensor(COUNTS), x.device)  # device counts: no host sync
    out, grad_x, grad_w = _run(lambda a, b: grouped_linear(a, b, offsets, mask_tail=True), x, w, grad)
    assert torch.count_nonzero(out[ROWS:]) == 0 and torch.count_nonzero(grad_x[ROWS:]) == 0
    looped = _run(lambda a, b: looped_linear(a, b, COUNTS), x, w, grad)
    for mine, loop in zip((out, grad_x, grad_w), looped):
        torch.testing.assert_close(mine, loop, rtol=1e-5, atol=1e-6)


def test_offsets_must_be_int32_cumulative_ends():
    x, w, _ = _inputs(torch.float32)
    assert offsets_of(COUNTS, x.device).tolist() == [5, 5, 12, 16]
    assert offsets_of(torch.tensor(COUNTS), x.device).dtype == torch.int32
    with pytest.raises(ValueError, match=r"offsets: int32 of shape \(4,\), got torch.int64"):
        grouped_linear(x, w, torch.tensor([5, 5, 12, 16]))


def test_the_stride_and_dtype_limits_are_named():
    assert fallback_reason(torch.bfloat16, {"--hidden-size": 64, "--moe-ffn-hidden-size": 48}) is None
    reason = fallback_reason(torch.bfloat16, {"--hidden-size": 60})
    assert reason == "--hidden-size 60 x 2 bytes is not a multiple of 16 bytes (the grouped GEMM's strides)"
    assert fallback_reason(torch.float32, {"--hidden-size": 64}) == "float32 on cuda (its grouped GEMM takes bfloat16)"
    assert fallback_reason(torch.float32, {"--hidden-size": 64}, "cpu") is None
    assert "float64 on cpu" in fallback_reason(torch.float64, {"--hidden-size": 64}, "cpu")


def _config(**overrides) -> TransformerConfig:
    fields = dict(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        vocab_size=64,
        seq_length=16,
        swiglu=True,
        add_bias_linear=False,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
    )
    return TransformerConfig(**(fields | overrides))


def test_misaligned_shapes_fall_back_to_one_gemm_per_expert_with_a_note():
    config = _config(moe_ffn_hidden_size=6, moe_grouped_gemm=True)  # 6 x 4 bytes
    notes = moe_notes(config)
    assert (
        "> note: --moe-grouped-gemm: float32 on cuda (its grouped GEMM takes bfloat16); there the grouped" in notes[2]
    )
    assert "--moe-grouped-gemm: --moe-ffn-hidden-size / expert-tensor-parallel size (1) 6 x 4 bytes" in notes[3]
    experts = GroupedExperts(config, range(8))
    initialize_parameters(experts, 1)
    loop = SequentialExperts(config, range(8))
    initialize_parameters(loop, 1)
    tokens, probs = torch.randn(10, 32), torch.rand(10)
    counts = [3, 0, 2, 0, 1, 1, 3, 0]
    assert not experts.runs_grouped(tokens)
    torch.testing.assert_close(experts(tokens, counts, probs), loop(tokens, counts, probs))
    bf16 = moe_notes(_config(moe_grouped_gemm=True, params_dtype=torch.bfloat16))
    assert bf16[1:] == ["> MoE: grouped experts run by torch.nn.functional.grouped_mm"]


def _layer(grouped: bool):
    layer = MoELayer(_config(moe_grouped_gemm=grouped), tp_group=None)
    initialize_parameters(layer, 1234)
    hidden = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out = layer(hidden)
    out.backward(torch.full_like(out, 0.1))
    grads = {n: t for name, p in layer.named_parameters() for n, t, _ in expert_tensors(name, p.grad, p.init_spec)}
    pieces = {piece.name: piece.tensor() for piece in model_pieces(layer.named_parameters(), tied_copies=False)}
    return out.detach(), hidden.grad, grads, pieces


def test_grouped_moe_layer_has_the_loops_weights_pieces_and_gradients():
    grouped, loop = _layer(True), _layer(False)
    assert grouped[3].keys() == loop[3].keys()  # the canonical (checkpoint) names: the loop's per-expert ones
    assert all(torch.equal(grouped[3][name], loop[3][name]) for name in loop[3])  # one model, any expert layout
    assert grouped[2].keys() == loop[2].keys()
    torch.testing.assert_close(grouped[0], loop[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(grouped[1], loop[1], rtol=1e-6, atol=1e-9)
    for name in loop[2]:
        torch.testing.assert_close(grouped[2][name], loop[2][name], rtol=1e-6, atol=1e-9, msg=name)


def test_grouped_experts_with_bias_are_refused_by_name():
    with pytest.raises(ValueError, match="--num-experts needs --disable-bias-linear"):
        _config(add_bias_linear=True, moe_grouped_gemm=True)


def test_grouped_linear_is_the_same_as_f_linear_for_one_expert():
    x, w, _ = _inputs(torch.float32)
    out = grouped_linear(x, w[:1], offsets_of([ROWS], x.device))
    torch.testing.assert_close(out, F.linear(x, w[0]))


PADDED = dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True, moe_token_drop_policy="position")


@pytest.mark.parametrize("routing", [{}, dict(moe_expert_capacity_factor=1.0), PADDED], ids=["dropless", "drop", "pad"])
def test_host_syncs_per_layer_none_with_allgather_one_with_alltoall(routing):
    """Grouped experts under allgather read nothing to the host (a fixed row bound, counts on the device); alltoall
    reads its split sizes once; the loop under allgather reads its rows per expert once. Same output and input
    gradient in all three."""
    from megatron.core.transformer.moe.token_dispatcher import HOST_SYNCS

    results = {}
    for grouped, dispatcher, syncs in [(False, "allgather", 1), (True, "allgather", 0), (True, "alltoall", 1)]:
        config = _config(**routing, moe_grouped_gemm=grouped, moe_token_dispatcher_type=dispatcher)
        layer = MoELayer(config, tp_group=None)
        initialize_parameters(layer, 1)
        hidden = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
        HOST_SYNCS.reads = 0
        out = layer(hidden)
        out.backward(torch.ones_like(out))
        assert HOST_SYNCS.reads == syncs, (grouped, dispatcher)
        results[(grouped, dispatcher)] = out.detach(), hidden.grad
    loop = results[(False, "allgather")]
    for mine in results.values():
        torch.testing.assert_close(mine[0], loop[0], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(mine[1], loop[1], rtol=1e-6, atol=1e-9)
