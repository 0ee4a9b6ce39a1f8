#!/usr/bin/env python
"""Our Triton kernels vs torch (and apex when importable) on one GPU, side by side.

    python tools/bench/kernels.py [--dtype bf16] [--kernels attention,rms_norm,layer_norm,rope,swiglu]
                                  [--seqs 1024,2048,4096,8192,16384] [--hiddens 1024,2048,4096,8192,16384]

First measures this GPU's peaks: dense matmul TFLOP/s (the dtype under test, 8192^3) and
copy GB/s (a 1 GiB clone). Then, per shape, times forward and backward of each
implementation on the same inputs with triton.testing.do_bench (median, L2 flushed between
runs) and prints TFLOP/s (attention: 4*b*h*s_q*s_k*d per forward, halved when causal,
backward counted as 2.5x forward) or GB/s (norms: bytes of x, y, dy, dx that must move;
weights and statistics are ignored; RoPE: q and k in and out; SwiGLU: its input and output),
the % of the measured peak, and speed relative to torch
(time_torch / time_ours; above 1 means ours is faster). Before timing, each implementation's
forward output is compared with torch's ('check' column).

Torch baselines: scaled_dot_product_attention with its default backend choice (flash on
recent GPUs for fp16/bf16) on the same [b, s, h, d] tensors transposed to [b, h, s, d]
views; torch.nn.functional.rms_norm / layer_norm; RoPE and SwiGLU: their torch references
(kernels/rope.py `rope_torch`, megatron-core's unfused rotation; `swiglu_torch`). apex: FusedRMSNorm / FusedLayerNorm
(apex has no comparable attention op). Needs a CUDA GPU; without one it exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def bench_ms(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def measure_peaks(dtype):
    """(matmul TFLOP/s, copy GB/s) measured on this GPU."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=dtype) for _ in range(2))
    tflops = 2 * 8192**3 / bench_ms(lambda: a @ b) / 1e9
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    gbps = 2 * src.numel() / bench_ms(lambda: src.clone()) / 1e6
    return tflops, gbps


def fwd_bwd_ms(fn, inputs):
    """Forward time and backward time (gradients of all inputs) of fn(*inputs)."""
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    grads = [torch.randn_like(o) for o in outs]
    fwd = bench_ms(lambda: fn(*inputs))
    bwd = bench_ms(lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True))
    return fwd, bwd


def agreement(ours, reference, dtype):
    ours, reference = (out[0] if isinstance(out, tuple) else out for out in (ours, reference))  # RoPE: q
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    err = ((ours.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
    return f"{'ok' if err <= tol else 'MISMATCH'} {err:.1e}"


def attention_cases(args, dtype):
    from kernels.flash_attention import flash_attention

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=args.causal
        ).transpose(1, 2)

    heads, head_dim = args.heads, args.head_dim
    for seq in args.seqs:
        batch = max(1, args.tokens // seq)
        q, k, v = (
            torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)
        )
        flops = 4 * batch * heads * seq * seq * head_dim * (0.5 if args.causal else 1.0)
        impls = {"torch": sdpa, "ours": lambda q, k, v: flash_attention(q, k, v, causal=args.causal, impl="triton")}
        shape = f"b{batch} s{seq} h{heads} d{head_dim}{' causal' if args.causal else ''}"
        yield "attention", shape, impls, (q, k, v), ("TFLOP/s", flops, 2.5 * flops)


def norm_cases(kind, args, dtype):
    from kernels.normalization import layer_norm, rms_norm

    for hidden in args.hiddens:
        x = torch.randn(args.tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
        w = torch.ones(hidden, device="cuda", dtype=dtype, requires_grad=True)
        b = torch.zeros(hidden, device="cuda", dtype=dtype, requires_grad=True)
        if kind == "rms_norm":
            inputs = (x, w)
            impls = {
                "torch": lambda x, w, hidden=hidden: F.rms_norm(x, (hidden,), w, 1e-5),
                "ours": lambda x, w: rms_norm(x, w, 1e-5, impl="triton"),
            }
        else:
            inputs = (x, w, b)
            impls = {
                "torch": lambda x, w, b, hidden=hidden: F.layer_norm(x, (hidden,), w, b, 1e-5),
                "ours": lambda x, w, b: layer_norm(x, w, b, 1e-5, impl="triton"),
            }
        apex = apex_norm(kind, hidden, w, b)
        if apex is not None:
            impls["apex"] = apex
        row_bytes = x.numel() * x.element_size()
        yield kind, f"{args.tokens}x{hidden}", impls, inputs, ("GB/s", 2 * row_bytes, 3 * row_bytes)


def rope_cases(args, dtype):
    """RoPE of q and k at Llama-3-8B's heads (32 q, 8 kv, head dim 128), all channels rotating, against
    megatron-core's unfused rotation (`rope_torch`); bytes: q and k read and written."""
    from kernels.rope import rope, rope_torch
    from megatron.core.transformer.rotary import rotary_frequencies

    angles = rotary_frequencies(args.tokens, 128, 500000.0, device="cuda", scaling_factor=8.0)
    q, k = (torch.randn(args.tokens, 1, h, 128, device="cuda", dtype=dtype, requires_grad=True) for h in (32, 8))
    impls = {"torch": lambda q, k: rope_torch(q, k, angles), "ours": lambda q, k: rope(q, k, angles, impl="triton")}
    moved = 2 * (q.numel() + k.numel()) * q.element_size()
    yield "rope", f"{args.tokens}x(32+8)x128", impls, (q, k), ("GB/s", moved, moved)


def swiglu_cases(args, dtype):
    """SwiGLU of [tokens, 2 f] at f = Llama-3-8B's 14336, with and without bias; bytes: forward reads
    2f and writes f, backward reads 2f and dy (f) and writes 2f, per row."""
    from kernels.swiglu import swiglu, swiglu_torch

    width = 14336
    h = torch.randn(args.tokens, 2 * width, device="cuda", dtype=dtype, requires_grad=True)
    bias = torch.randn(2 * width, device="cuda", dtype=dtype, requires_grad=True)
    row = args.tokens * width * h.element_size()
    cases = {
        "plain": ((h,), lambda h: swiglu_torch(h), lambda h: swiglu(h, impl="triton")),
        "bias": ((h, bias), swiglu_torch, lambda h, b: swiglu(h, b, impl="triton")),
    }
    for label, (inputs, reference, ours) in cases.items():
        yield (
            "swiglu",
            f"{args.tokens}x2x{width} {label}",
            {"torch": reference, "ours": ours},
            inputs,
            (
                "GB/s",
                3 * row,
                5 * row,
            ),
        )


CASES = {"attention": attention_cases, "rope": rope_cases, "swiglu": swiglu_cases}


def apex_norm(kind, hidden, weight, bias):
    """apex's fused norm as a function of the same inputs, or None without apex."""
    try:
        from apex.normalization import FusedLayerNorm, FusedRMSNorm
    except ImportError:
        return None
    module = (FusedRMSNorm if kind == "rms_norm" else FusedLayerNorm)(hidden, eps=1e-5).to(weight)
    if kind == "rms_norm":
        return lambda x, w: torch.func.functional_call(module, {"weight": w}, (x,))
    return lambda x, w, b: torch.func.functional_call(module, {"weight": w, "bias": b}, (x,))


def run_case(name, shape, impls, inputs, units, peaks, dtype):
    unit, fwd_work, bwd_work = units
    peak = peaks[0] if unit == "TFLOP/s" else peaks[1]
    scale = 1e9 if unit == "TFLOP/s" else 1e6  # work per ms -> TFLOP/s or GB/s
    reference = impls["torch"](*inputs)
    times = {}
    for impl, fn in impls.items():
        check = "-" if impl == "torch" else agreement(fn(*inputs), reference, dtype)
        times[impl] = fwd_bwd_ms(fn, inputs)
        for i, (label, work) in enumerate((("fwd", fwd_work), ("bwd", bwd_work))):
            ms = times[impl][i]
            rate = work / ms / scale
            ratio = times["torch"][i] / ms
            print(
                f"{name:<10} {shape:<26} {label:<4} {impl:<6} {ms:9.3f} {rate:9.1f} {unit:<8} "
                f"{100 * rate / peak:6.1f}% {ratio:8.2f}x  {check}",
                flush=True,
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--kernels", default="attention,rms_norm,layer_norm,rope,swiglu")
    parser.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    parser.add_argument("--hiddens", default="1024,2048,4096,8192,16384")
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seq per attention shape; rows for norms")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    args.seqs = [int(s) for s in args.seqs.split(",")]
    args.hiddens = [int(h) for h in args.hiddens.split(",")]
    if not torch.cuda.is_available():
        print("tools/bench/kernels.py: a CUDA GPU is required; nothing was measured.", file=sys.stderr)
        return 2
    import triton

    dtype = DTYPES[args.dtype]
    peaks = measure_peaks(dtype)
    print(
        f"# {torch.cuda.get_device_name()}  {datetime.date.today()}  torch {torch.__version__}  "
        f"triton {triton.__version__}  {args.dtype}"
    )
    print(f"# measured peaks: matmul {peaks[0]:.1f} TFLOP/s, copy {peaks[1]:.1f} GB/s")
    print(
        f"{'kernel':<10} {'shape':<26} {'pass':<4} {'impl':<6} {'ms':>9} {'rate':>9} {'unit':<8} "
        f"{'%peak':>7} {'vs torch':>9}  check"
    )
    for kernel in args.kernels.split(","):
        cases = CASES[kernel](args, dtype) if kernel in CASES else norm_cases(kernel, args, dtype)
        for case in cases:
            run_case(*case, peaks, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
