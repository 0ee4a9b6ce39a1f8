"""Part kernels-step, 1: our Triton kernels at real sizes against an fp32 reference and torch's own.

Per case and implementation (ours, torch, apex where importable), forward and backward: the
max and mean absolute error against the fp32 reference (attention: batch element 0, computed
by SDPA in fp32 with K/V heads repeated so the memory-efficient backend runs, never the s x s
math path; norms: torch's in fp32 on the whole input), the error relative to the reference's
largest value, time (triton.testing.do_bench median, tools/bench/kernels.py's timing) and rate
(attention TFLOP/s: 4 b h s^2 d per forward, halved causal, backward 2.5x; norms GB/s: the bytes
of x, y, dy, dx), and speed vs torch (time torch / time ours). A case that fails (compilation,
an unsupported shape) is one row with the error's first line; the check goes on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.cross_entropy import unsupported_reason as cross_entropy_unsupported
from kernels.flash_attention import flash_attention, flash_attention_torch
from kernels.flash_attention import unsupported_reason as attention_unsupported
from kernels.normalization import layer_norm, layer_norm_torch, rms_norm, rms_norm_torch
from kernels.normalization import unsupported_reason as norm_unsupported
from kernels.triton_support import kernel_path
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.fused_cross_entropy import fused_output_cross_entropy
from tools.gpu_check_lib.report import NA
from tools.gpu_check_lib.runs import error_line

COLUMNS = ["case", "pass", "impl", "path", "max err", "mean err", "rel err", "ms", "rate", "unit", "vs torch"]
REAL = dict(tokens=65536, seqs=(2048, 8192), hidden=4096, rows=16384, norm_hiddens=(4096, 8192), head=(8192, 128256))
DRY = dict(tokens=16, seqs=(16, 32), heads=2, rows=32, norm_hiddens=(64, 128), hidden=64, head=(24, 200))


def _errors(pairs) -> tuple[float, float, float]:
    """(max abs, mean abs, max abs / reference max) over (actual, fp32 reference) pairs."""
    diffs = [(a.float() - r).abs() for a, r in pairs]
    max_abs = max(d.max().item() for d in diffs)
    mean_abs = sum(d.sum().item() for d in diffs) / sum(d.numel() for d in diffs)
    ref_max = max(r.abs().max().item() for _, r in pairs)
    return max_abs, mean_abs, max_abs / max(ref_max, 1e-12)


def _grads(fn, inputs, dout):
    out = fn(*inputs)
    return out, torch.autograd.grad(out, inputs, dout)


def _timed(ctx, fn, inputs):
    if ctx.dry_run:
        return NA, NA
    from tools.bench.kernels import fwd_bwd_ms

    return fwd_bwd_ms(fn, inputs)


def _rows(section, ctx, case, impls, inputs, reference, slicer, units, dout):
    """One forward and one backward row per implementation; `slicer` cuts what the reference covers."""
    unit, fwd_work, bwd_work = units
    times = {}
    for impl, (path, fn) in impls.items():
        try:
            out, grads = _grads(fn, inputs, dout)
            fwd = _errors([(slicer(out), reference[0])])
            bwd = _errors([(slicer(g), r) for g, r in zip(grads, reference[1])])
            times[impl] = _timed(ctx, fn, inputs)
        except Exception as error:  # a compile error, an unsupported backend: one row, go on
            section.add(**{"case": case, "pass": "-", "impl": impl, "path": f"error: {error_line(error)}"})
            continue
        for index, (name, err, work) in enumerate((("fwd", fwd, fwd_work), ("bwd", bwd, bwd_work))):
            ms = times[impl][index]
            rate = NA if ctx.dry_run else work / ms / (1e9 if unit == "TFLOP/s" else 1e6)
            torch_ms = times.get("torch", (None, None))[index]
            ratio = NA if ctx.dry_run else (torch_ms / ms if torch_ms else None)
            row = dict(case=case, impl=impl, path=path, ms=ms, rate=rate, unit=unit)
            row.update({"max err": err[0], "mean err": err[1], "rel err": err[2], "vs torch": ratio})
            section.rows.append(dict(row, **{"pass": name}))


def attention_cases(section, ctx, sizes, dtype):
    for head_dim in (64, 128):
        heads = sizes.get("heads") or sizes["hidden"] // head_dim  # dry run: 2 heads (the interpreter's cost)
        for groups in (heads, heads // 2 if ctx.dry_run else 8):
            for seq in sizes["seqs"]:
                batch = max(1, sizes["tokens"] // seq)
                case = f"attention b{batch} s{seq} h{heads} g{groups} d{head_dim} causal"
                try:
                    _attention_case(section, ctx, case, batch, seq, heads, groups, head_dim, dtype)
                except Exception as error:  # out of memory building the inputs, ...
                    section.add(case=case, impl="-", path=f"error: {error_line(error)}")


def _attention_case(section, ctx, case, batch, seq, heads, groups, head_dim, dtype):
    device = ctx.device
    gen = torch.Generator(device).manual_seed(seq + heads + groups)
    q = torch.randn(batch, seq, heads, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()
    k, v = (
        torch.randn(batch, seq, groups, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()
        for _ in range(2)
    )
    dout = torch.randn(q.shape, device=device, dtype=dtype, generator=gen)
    rep = heads // groups
    ref_in = [t[:1].detach().float().requires_grad_() for t in (q, k, v)]
    ref_out = flash_attention_torch(
        ref_in[0], ref_in[1].repeat_interleave(rep, 2), ref_in[2].repeat_interleave(rep, 2), causal=True
    )
    reference = (ref_out.detach(), torch.autograd.grad(ref_out, ref_in, dout[:1].float()))
    ours_path = kernel_path("triton" if ctx.dry_run else "auto", device, attention_unsupported(head_dim, dtype, device))
    impl = "triton" if ours_path.startswith("triton") else "auto"
    gqa = heads != groups

    def sdpa_flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=gqa
            )
        return out.transpose(1, 2)

    impls = {
        "torch": ("sdpa flash backend", sdpa_flash),
        "ours": (ours_path, lambda q, k, v: flash_attention(q, k, v, causal=True, impl=impl)),
    }
    flops = 4 * batch * heads * seq * seq * head_dim * 0.5
    _rows(section, ctx, case, impls, (q, k, v), reference, lambda t: t[:1], ("TFLOP/s", flops, 2.5 * flops), dout)


def norm_cases(section, ctx, sizes, dtype):
    for kind in ("rms_norm", "layer_norm"):
        for hidden in sizes["norm_hiddens"]:
            case = f"{kind} {sizes['rows']}x{hidden}"
            try:
                _norm_case(section, ctx, case, kind, sizes["rows"], hidden, dtype)
            except Exception as error:
                section.add(case=case, impl="-", path=f"error: {error_line(error)}")


def _norm_case(section, ctx, case, kind, rows, hidden, dtype):
    from tools.bench.kernels import apex_norm

    device, eps = ctx.device, 1e-5
    gen = torch.Generator(device).manual_seed(hidden)
    x = torch.randn(rows, hidden, device=device, dtype=dtype, generator=gen).requires_grad_()
    w = (1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype, generator=gen)).requires_grad_()
    b = (0.1 * torch.randn(hidden, device=device, dtype=dtype, generator=gen)).requires_grad_()
    inputs = (x, w) if kind == "rms_norm" else (x, w, b)
    dout = torch.randn(x.shape, device=device, dtype=dtype, generator=gen)
    ref_in = [t.detach().float().requires_grad_() for t in inputs]
    ref_fn = rms_norm_torch if kind == "rms_norm" else layer_norm_torch
    ref_out = ref_fn(*ref_in, eps)
    reference = (ref_out.detach(), torch.autograd.grad(ref_out, ref_in, dout.float()))
    path = kernel_path("triton" if ctx.dry_run else "auto", device, norm_unsupported(hidden, dtype))
    impl = "triton" if path.startswith("triton") else "auto"
    if kind == "rms_norm":
        impls = {
            "torch": ("F.rms_norm", lambda x, w: F.rms_norm(x, (hidden,), w, eps)),
            "ours": (path, lambda x, w: rms_norm(x, w, eps, impl=impl)),
        }
    else:
        impls = {
            "torch": ("F.layer_norm", lambda x, w, b: F.layer_norm(x, (hidden,), w, b, eps)),
            "ours": (path, lambda x, w, b: layer_norm(x, w, b, eps, impl=impl)),
        }
    apex = apex_norm(kind, hidden, w, b) if ctx.cuda else None
    if apex is not None:
        impls["apex"] = ("apex fused", apex)
    row_bytes = x.numel() * x.element_size()
    _rows(section, ctx, case, impls, inputs, reference, lambda t: t, ("GB/s", 2 * row_bytes, 3 * row_bytes), dout)


def output_cross_entropy_case(section, ctx, sizes, dtype):
    """The output layer + cross-entropy at Llama-3's vocabulary: fused (--cross-entropy-loss-fusion)
    against the unfused path (the "torch" row: the logits GEMM, then the vocab-parallel cross-entropy)."""
    (tokens, vocab), hidden = sizes["head"], sizes["hidden"]
    case = f"lm head + cross entropy {tokens} tokens, h{hidden}, vocab {vocab}"
    try:
        device = ctx.device
        gen = torch.Generator(device).manual_seed(vocab)
        x = torch.randn(tokens, 1, hidden, device=device, dtype=dtype, generator=gen).requires_grad_()
        w = (0.02 * torch.randn(vocab, hidden, device=device, dtype=dtype, generator=gen)).requires_grad_()
        target = torch.randint(0, vocab, (tokens, 1), device=device, generator=gen)
        dout = torch.rand(tokens, 1, device=device, generator=gen)
        ref_in = [t.detach().float().requires_grad_() for t in (x, w)]
        ref_out = F.cross_entropy(F.linear(*ref_in).flatten(0, 1), target.flatten(), reduction="none").view(tokens, 1)
        reference = (ref_out.detach(), torch.autograd.grad(ref_out, ref_in, dout))
        del ref_out, ref_in
        path = kernel_path("triton" if ctx.dry_run else "auto", device, cross_entropy_unsupported(dtype))
        impl = "triton" if path.startswith("triton") else "auto"
        impls = {
            "torch": ("unfused", lambda x, w: vocab_parallel_cross_entropy(F.linear(x, w), target, None, 0)),
            # the per-token output gradient as its loss weights: the fused forward computes the gradients
            "ours": (
                path,
                lambda x, w: fused_output_cross_entropy(x, w, target, tp_group=None, impl=impl, loss_mask=dout),
            ),
        }
        flops = 2 * tokens * hidden * vocab  # the logits GEMM (the fused forward runs all three: its fwd is slower)
        _rows(section, ctx, case, impls, (x, w), reference, lambda t: t, ("TFLOP/s", flops, 2 * flops), dout)
    except Exception as error:
        section.add(case=case, impl="-", path=f"error: {error_line(error)}")


def check_kernels(report, ctx) -> None:
    section = report.section("kernels", "Kernels (bf16) vs fp32 reference and torch", COLUMNS)
    sizes = DRY if ctx.dry_run else REAL
    attention_cases(section, ctx, sizes, torch.bfloat16)
    norm_cases(section, ctx, sizes, torch.bfloat16)
    output_cross_entropy_case(section, ctx, sizes, torch.bfloat16)
    section.notes.append(
        "max/mean err: absolute, against fp32 (attention: batch element 0); rel err: max err / the reference's "
        "largest value (the kernel tests' bf16 tolerance is 2e-2); bwd: all input gradients together"
    )
    section.notes.append(
        "vs torch: time of torch's / ours (above 1: ours faster); path: what impl='auto' runs (the trainer's "
        "choice; dry run: the interpreter, forced)"
    )
