"""Part throughput, attention: our flash kernel against every SDPA backend (flash, cuDNN, memory-efficient) at
the check's attention shapes (Llama-3-8B: 32 query heads, 8 K/V groups, head dim 128, causal, bf16; sequence
8192 and 2048, batch 1), forward and backward, each checked against the fp32 reference (kernels_check.py's:
SDPA in fp32 with K/V heads repeated). A backend that refuses the grouped K/V heads (`enable_gqa`) runs again
on K/V repeated to all heads, as a user of it would (the path column says so; the rule does not take it, since
our layers pass grouped K/V); one that refuses the shape anyway is a row with its error. The rows are what
kernels/attention_rule.py's rule reads (`measurements`); the note names what `auto` would take from them, and
the fastest correct SDPA backend is the one the bare PyTorch rows of the throughput table pin."""

from __future__ import annotations

import datetime

import torch
import torch.nn.functional as F

from kernels.attention_rule import DTYPE_NAMES, SDPA_BACKENDS, TOLERANCE, Measurement, fastest, pinned_backend
from kernels.flash_attention import flash_attention, flash_attention_torch
from tools.gpu_check_lib.kernels_check import _errors, _grads, _timed
from tools.gpu_check_lib.report import NA
from tools.gpu_check_lib.runs import error_line, free_device_memory

REPEATED = "K/V repeated"
COLUMNS = ["case", "path", "correct", "fwd rel err", "bwd rel err", "fwd ms", "bwd ms", "TFLOP/s", "vs ours"]
REAL = dict(seqs=(8192, 2048), heads=32, groups=8, head_dim=128)
DRY = dict(seqs=(32, 16), heads=2, groups=1, head_dim=64)  # a head dim our kernel takes, 2 query heads a group


def _sdpa(backend: str, repeat: int):
    """SDPA pinned to `backend` on [b, s, h, d] inputs; K/V heads repeated `repeat` times (1: enable_gqa)."""

    def run(q, k, v):
        if repeat > 1:
            k, v = (t.repeat_interleave(repeat, dim=2) for t in (k, v))
        with pinned_backend(backend):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=repeat == 1
            )
        return out.transpose(1, 2)

    return run


def _inputs(ctx, seq: int, sizes: dict, dtype):
    gen = torch.Generator(ctx.device).manual_seed(seq)
    heads, groups, d = sizes["heads"], sizes["groups"], sizes["head_dim"]
    q = torch.randn(1, seq, heads, d, device=ctx.device, dtype=dtype, generator=gen).requires_grad_()
    k, v = (
        torch.randn(1, seq, groups, d, device=ctx.device, dtype=dtype, generator=gen).requires_grad_() for _ in "kv"
    )
    dout = torch.randn(q.shape, device=ctx.device, dtype=dtype, generator=gen)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    rep = heads // groups
    ref_out = flash_attention_torch(
        ref_in[0], ref_in[1].repeat_interleave(rep, 2), ref_in[2].repeat_interleave(rep, 2), causal=True
    )
    reference = (ref_out.detach(), torch.autograd.grad(ref_out, ref_in, dout.float()))
    return (q, k, v), dout, reference


def _measure(ctx, fn, inputs, dout, reference):
    """(fwd rel err, bwd rel err, fwd ms, bwd ms) of `fn`."""
    out, grads = _grads(fn, inputs, dout)
    fwd = _errors([(out, reference[0])])[2]
    bwd = _errors(list(zip(grads, reference[1])))[2]
    fwd_ms, bwd_ms = _timed(ctx, fn, inputs)
    return fwd, bwd, fwd_ms, bwd_ms


def _paths(ctx, rep: int):
    """(name, fn, fallback) per path: ours, then each SDPA backend with enable_gqa and its K/V-repeated fallback."""
    impl = "triton"  # our kernel (on a dry run under the interpreter)
    yield "ours", lambda q, k, v: flash_attention(q, k, v, causal=True, impl=impl), None
    for backend in SDPA_BACKENDS:
        yield backend, _sdpa(backend, 1), _sdpa(backend, rep)


def _case(section, ctx, seq: int, sizes: dict, dtype) -> None:
    heads, groups, d = sizes["heads"], sizes["groups"], sizes["head_dim"]
    case = f"b1 s{seq} h{heads} g{groups} d{d} causal"
    inputs, dout, reference = _inputs(ctx, seq, sizes, dtype)
    flops = 3.5 * 4 * heads * seq * seq * d * 0.5  # forward 4 h s^2 d halved causal, backward 2.5x
    ours_ms = None
    for name, fn, fallback in _paths(ctx, heads // groups):
        path = name if name == "ours" else f"sdpa {name}"
        try:
            figures = _measure(ctx, fn, inputs, dout, reference)
        except (RuntimeError, ValueError) as error:  # no kernel for these inputs; ours refusing the shape
            if fallback is None:
                section.add(case=case, path=path, correct=f"error: {error_line(error)}")
                continue
            try:
                figures = _measure(ctx, fallback, inputs, dout, reference)
                path += f" ({REPEATED}: enable_gqa refused)"
            except RuntimeError as error:
                section.add(case=case, path=path, correct=f"error: {error_line(error)}")
                continue
        fwd_err, bwd_err, fwd_ms, bwd_ms = figures
        total = fwd_ms + bwd_ms if isinstance(fwd_ms, float) else NA
        ours_ms = total if name == "ours" else ours_ms
        section.add(
            case=case,
            path=path,
            correct=max(fwd_err, bwd_err) <= TOLERANCE,
            **{"fwd rel err": fwd_err, "bwd rel err": bwd_err, "fwd ms": fwd_ms, "bwd ms": bwd_ms},
            **{"TFLOP/s": flops / total / 1e9 if isinstance(total, float) else NA},
            **{"vs ours": ours_ms / total if isinstance(total, float) and isinstance(ours_ms, float) else NA},
        )
    free_device_memory(ctx)


def measurements(rows: list[dict], capability, dtype: str, device: str) -> list[Measurement]:
    """The section's timed rows as kernels/attention_rule.py `Measurement`s, but those that ran on K/V repeated: our
    layers and the bare loop call SDPA with grouped K/V heads, which that backend refused."""
    date = datetime.date.today().isoformat()
    out = []
    for row in rows:
        if not isinstance(row.get("fwd ms"), float) or REPEATED in row["path"]:
            continue
        seq, d = (int(part[1:]) for part in row["case"].split() if part[0] in "sd" and part[1:].isdigit())
        name = row["path"].split(" (")[0].removeprefix("sdpa ")
        source = f"{device}, {date}, GPU check section attention_backends"
        out.append(
            Measurement(tuple(capability), d, dtype, seq, name, row["fwd ms"] + row["bwd ms"], row["correct"], source)
        )
    return out


def check_attention(report, ctx) -> str | None:
    """Write the section; return the fastest correct SDPA backend at the longest sequence (None: none timed)."""
    section = report.section("attention_backends", "Attention: our kernel vs each SDPA backend (bf16)", COLUMNS)
    sizes = DRY if ctx.dry_run else REAL
    for seq in sizes["seqs"]:
        try:
            _case(section, ctx, seq, sizes, torch.bfloat16)
        except Exception as error:  # out of memory building the inputs
            section.add(case=f"s{seq}", path="-", correct=f"error: {error_line(error)}")
    section.notes.append(
        f"correct: output and all input gradients within {TOLERANCE} of the fp32 reference relative to its largest "
        "value; TFLOP/s: forward + backward (forward 4 h s^2 d halved causal, backward 2.5x); vs ours: our time / "
        "this path's (above 1: this path faster)"
    )
    if not ctx.cuda:
        section.notes.append("auto's rule (kernels/attention_rule.py) reads CUDA timings: none on a dry run")
        return None
    capability = torch.cuda.get_device_capability(ctx.device)
    found = measurements(section.rows, capability, DTYPE_NAMES[torch.bfloat16], torch.cuda.get_device_name(ctx.device))
    for seq in sizes["seqs"]:
        picked = fastest(found, capability, sizes["head_dim"], "bf16", seq)
        section.notes.append(f"auto's rule on these rows at s{seq}: {picked} (kernels/attention_rule.py MEASURED)")
    sdpa = [m for m in found if m.path in SDPA_BACKENDS]
    return fastest(sdpa, capability, sizes["head_dim"], "bf16", max(sizes["seqs"]))
