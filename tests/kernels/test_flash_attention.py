"""Flash attention: the Triton kernels (run by the interpreter, TRITON_INTERPRET=1 from conftest)
against the torch reference in float64, plus the dispatcher.

Inputs are fresh random tensors each run; the seed is in every failure message. Every kernel
output buffer starts as NaN (the allocator is patched), so an element a kernel fails to write
fails the comparison.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import flash_attention as fa
from kernels import triton_support
from tests.kernels.checks import TOL, assert_close

pytest.importorskip("triton")


def qkv(batch, s_q, s_k, heads, kv_heads, head_dim, dtype):
    q = torch.randn(batch, s_q, heads, head_dim, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, s_k, kv_heads, head_dim, dtype=dtype, requires_grad=True) for _ in range(2))
    return q, k, v


def float64_leaves(*tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


# (batch, s_q, s_k, heads, kv_heads, head_dim): GQA, MHA, MQA; exact and ragged block multiples
SHAPES = [(1, 256, 256, 4, 2, 64), (2, 197, 197, 2, 2, 64), (1, 77, 150, 2, 1, 64), (1, 70, 70, 1, 1, 128)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_sq{}_sk{}_h{}_kv{}_d{}".format(*s))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_block_attention_matches_float64_reference(shape, causal, dtype, seed):
    """Output, log-sum-exp and dQ/dK/dV, with gradient flowing in through both outputs."""
    q, k, v = qkv(*shape, dtype)
    out, lse = fa.flash_attention_block(q, k, v, causal, impl="triton")
    d_out, d_lse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), (q, k, v))

    ref_inputs = float64_leaves(q, k, v)
    ref_out, ref_lse = fa.flash_attention_block_torch(*ref_inputs, causal)
    ref_grads = torch.autograd.grad((ref_out * d_out.double()).sum() + (ref_lse * d_lse.double()).sum(), ref_inputs)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (shape[0], shape[3], shape[1])
    names = ("out", "lse", "dq", "dk", "dv")
    for name, actual, expected in zip(names, (out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
        assert_close(name, actual, expected, TOL[dtype], seed)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_flash_attention_matches_sdpa_in_float64(causal, dtype, seed):
    """The output-only entry point (no lse gradient) against scaled_dot_product_attention."""
    q, k, v = qkv(2, 130, 130, 2, 1, 64, dtype)
    out = fa.flash_attention(q, k, v, causal=causal, softmax_scale=0.05, impl="triton")
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad((out * d_out).sum(), (q, k, v))

    ref_inputs = float64_leaves(q, k, v)
    ref_out = fa.flash_attention_torch(*ref_inputs, causal=causal, softmax_scale=0.05)
    ref_grads = torch.autograd.grad((ref_out * d_out.double()).sum(), ref_inputs)
    for name, actual, expected in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        assert_close(name, actual, expected, TOL[dtype], seed)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_blocks_merged_equal_attention_over_concatenated_kv(impl, seed):
    """Ring-attention use: the last query chunk against K/V split into an earlier part (no mask)
    and its own diagonal part (causal), merged by lse, equals causal attention over all keys;
    gradients through the merge match too."""
    dtype, chunk = torch.float32, 64
    q_all, k, v = qkv(1, 160, 160, 4, 2, 64, dtype)
    q = q_all[:, -chunk:].detach().requires_grad_()
    early = fa.flash_attention_block(q, k[:, :-chunk], v[:, :-chunk], causal=False, impl=impl)
    diagonal = fa.flash_attention_block(q, k[:, -chunk:], v[:, -chunk:], causal=True, impl=impl)
    out, lse = fa.merge_attention_blocks(*early, *diagonal)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad((out * d_out).sum(), (q, k, v))

    ref_q_all, ref_k, ref_v = float64_leaves(q_all, k, v)
    ref_out, ref_lse = fa.flash_attention_block_torch(ref_q_all, ref_k, ref_v, causal=True)
    ref_out, ref_lse = ref_out[:, -chunk:], ref_lse[..., -chunk:]
    ref_grads = torch.autograd.grad((ref_out * d_out.double()).sum(), (ref_q_all, ref_k, ref_v))
    ref_grads = (ref_grads[0][:, -chunk:], *ref_grads[1:])
    names = ("out", "lse", "dq", "dk", "dv")
    for name, actual, expected in zip(names, (out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
        assert_close(name, actual, expected, TOL[dtype], seed)


def test_merge_with_empty_accumulator_is_identity():
    out, lse = torch.randn(1, 5, 2, 8, requires_grad=True), torch.randn(1, 2, 5, requires_grad=True)
    empty_out, empty_lse = torch.zeros(1, 5, 2, 8), torch.full((1, 2, 5), float("-inf"))
    merged, merged_lse = fa.merge_attention_blocks(empty_out, empty_lse, out, lse)
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(merged_lse, lse)
    both_empty, both_lse = fa.merge_attention_blocks(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(both_empty, empty_out) and torch.isneginf(both_lse).all()
    (merged.sum() + merged_lse.sum()).backward()
    assert torch.isfinite(out.grad).all() and torch.isfinite(lse.grad).all()


# ----------------------------------------------------------------------------- dispatcher
def test_impl_strings_are_validated():
    q, k, v = qkv(1, 8, 8, 2, 1, 16, torch.float32)
    for bad in ("cuda", "Triton", None):
        with pytest.raises(ValueError, match="impl must be one of"):
            fa.flash_attention(q, k, v, impl=bad)
    with pytest.raises(ValueError, match="impl must be one of"):
        triton_support.kernel_path("fast", "cpu")


def test_auto_on_cpu_runs_the_torch_reference(monkeypatch, seed):
    def no_kernel(*args):
        raise AssertionError("the Triton kernel ran for impl='auto' on CPU")

    monkeypatch.setattr(fa, "_attn_forward", no_kernel)
    q, k, v = qkv(1, 20, 20, 4, 2, 16, torch.float32)
    assert_close(
        "auto", fa.flash_attention(q, k, v, impl="auto"), fa.flash_attention_torch(q, k, v).double(), 0.0, seed
    )
    out, lse = fa.flash_attention_block(q, k, v, causal=True, impl="auto")
    assert lse.shape == (1, 4, 20)
    assert triton_support.kernel_path("auto", "cpu") == "torch (tensors on CPU)"
    assert triton_support.kernel_path("triton", "cpu") == "triton (interpreter)"
    assert triton_support.kernel_path("torch", "cuda") == "torch (impl='torch')"


def test_unsupported_inputs_are_refused_by_triton_and_routed_to_torch_by_auto():
    q, k, v = qkv(1, 16, 16, 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=r"head dims \(64, 128\), got 16"):
        fa.flash_attention(q, k, v, impl="triton")
    assert fa.flash_attention(q, k, v, impl="auto").shape == q.shape
    with pytest.raises(ValueError, match="fp16 and bf16"):
        fa.flash_attention(*(t.double() for t in qkv(1, 16, 16, 2, 2, 64, torch.float32)), impl="triton")
    assert fa.attention_path("auto", "cuda", 128, torch.bfloat16) == "triton"
    assert "head dims" in fa.attention_path("auto", "cuda", 16, torch.bfloat16)
    assert fa.attention_path("auto", "cuda", 128, torch.float32).startswith("torch (")
    assert fa.attention_path("triton", "cuda", 16, torch.bfloat16).startswith("error (")


def test_mismatched_shapes_are_refused():
    q, k, v = qkv(1, 16, 16, 3, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        fa.flash_attention(q, k, v, impl="torch")


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setattr(triton_support, "INTERPRETER", False)
    q, k, v = qkv(1, 16, 16, 2, 2, 64, torch.float32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fa.flash_attention(q, k, v, impl="triton")


def test_kernels_import_and_fall_back_without_triton():
    script = """
import sys
sys.modules["triton"] = None  # makes `import triton` raise ImportError
import torch
from kernels import flash_attention as fa, normalization as nm, triton_support
q = torch.randn(1, 8, 2, 16)
assert fa.flash_attention(q, q, q, impl="auto").shape == q.shape
assert nm.rms_norm(q, torch.ones(16), 1e-5).shape == q.shape
path = triton_support.kernel_path("auto", "cuda")
assert path == "torch (triton is not installed)", path
try:
    nm.layer_norm(q, torch.ones(16), None, 1e-5, impl="triton")
except RuntimeError as e:
    assert "triton is not installed" in str(e)
else:
    raise AssertionError("impl='triton' ran without triton")
"""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
