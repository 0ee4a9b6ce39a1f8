"""Ahead-of-time compilation of every kernel configuration for Hopper (sm_90), on a CPU-only machine.

The interpreter runs code that the GPU compiler may reject (layouts, shared memory, dtypes), so
each launch our host functions make is compiled for `GPUTarget("cuda", 90, 32)` through the
full pipeline: Triton IR -> TTGIR -> LLVM IR -> PTX -> cubin (ptxas from the triton wheel).

How: a worker subprocess (TRITON_INTERPRET=0, because under the interpreter `@triton.jit`
yields InterpretedFunction objects that `triton.compile` cannot take) replaces each kernel's
launch with a recorder and calls the real host functions on meta tensors (see _launch_cases:
attention for every GPU dtype x head dim x causal x lse-gradient; norms for every dtype x flag
combination at two tile sizes and every tile size for the heaviest variant; the cross-entropy
reductions for every dtype at two vocabulary sizes; RoPE and SwiGLU for every dtype at Llama-3-8B's
shapes and odd ones, each flag both ways; the MoE permutation at the GPU check's shapes). Each recorded
launch becomes a signature with the JIT's default specialisation (pointers and multiples of 16
marked 16-divisible, ints equal to 1 made constant) and is compiled with
`triton.compile(ASTSource(...), target=...)`. The test also fails if a kernel in the modules
has no recorded launch, so a new kernel cannot slip past it.

Checked per configuration: compiles to a non-empty cubin; dynamic shared memory from the
compiled metadata <= 232448 bytes (the SM90 opt-in limit); register and local-memory (spill)
use read from the cubin by cuobjdump: a spill (stack frame or local memory) fails the test,
except in the known case of the norm backward at hidden 16384, where the row's weight and the
fp32 dW/dB accumulators alone exceed what one program's registers hold (reported, not failed), and
the RoPE kernel's small stack frame for sin/cos of huge angles (`_known_spill`).
Not checked: anything at run time on a GPU (correctness there, speed, occupancy).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SM90_MAX_SHARED_BYTES = 232448


# ----------------------------------------------------------------------------- worker (subprocess)
def _launch_cases():
    """Call the host launch functions with the configurations they can pick (on meta tensors)."""
    import torch

    from kernels import cross_entropy as ce
    from kernels import flash_attention as fa
    from kernels import normalization as nm

    meta = dict(device="meta")
    for dtype in (torch.float16, torch.bfloat16):  # fp32 attention is interpreter-only (see unsupported_reason)
        for head_dim in fa.SUPPORTED_HEAD_DIMS:
            q = torch.empty(2, 1024, 16, head_dim, dtype=dtype, **meta)
            k = torch.empty(2, 1024, 4, head_dim, dtype=dtype, **meta)
            lse = torch.empty(2, 16, 1024, dtype=torch.float32, **meta)
            for causal in (False, True):
                fa._attn_forward(q, k, k, causal, 0.1)
                for dlse in (None, lse):
                    fa._attn_backward(q, k, k, q, lse, q, dlse, causal, 0.1)

    # One kv head: the JIT then specialises n_kv_heads == 1 into a constant.
    q, k = (torch.empty(2, 1024, heads, 128, dtype=torch.bfloat16, **meta) for heads in (16, 1))
    fa._attn_forward(q, k, k, True, 0.1)
    fa._attn_backward(q, k, k, q, torch.empty(2, 16, 1024, **meta), q, None, True, 0.1)

    def norm_calls(dtype, hidden, residual_dtype):
        x = torch.empty(4096, hidden, dtype=dtype, **meta)
        w = torch.empty(hidden, dtype=dtype, **meta)
        rstd = torch.empty(4096, dtype=torch.float32, **meta)
        res = None if residual_dtype is None else torch.empty(4096, hidden, dtype=residual_dtype, **meta)
        for is_rms, bias in ((True, None), (False, None), (False, w)):
            nm._norm_forward(x, res, w, bias, 1e-5, is_rms)
            nm._norm_backward(x, w, bias is not None, x, res, None if is_rms else rstd, rstd, is_rms)

    # Every flag and dtype combination at the smallest and the largest tile ...
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for hidden in (1000, nm.MAX_HIDDEN):
            for residual_dtype in (None, dtype, torch.float32):
                norm_calls(dtype, hidden, residual_dtype)
    # ... and every tile size for the heaviest variant.
    for hidden in (2**i for i in range(4, nm.MAX_HIDDEN.bit_length())):
        norm_calls(torch.bfloat16, hidden, torch.float32)

    # The fused cross-entropy's reductions, on a chunk of Llama-3's vocabulary over tp 2 and a small one.
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for vocab in (64128, 100):
            logits = torch.empty(256, vocab, dtype=dtype, **meta)
            target, per_token = torch.empty(256, dtype=torch.int64, **meta), torch.empty(256, **meta)
            ce._statistics(logits, target, vocab)
            ce._gradient(logits, target, vocab, per_token, per_token)
    from kernels import rope as rp
    from kernels import swiglu as sg

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        # RoPE: q and k strided views of a GQA QKV output, Llama-3-8B's 32 + 8 heads at 128 and odd head dims
        for head_dim in (64, 80, 96, 128):
            qkv = torch.empty(1024, 2, 8, 6, head_dim, dtype=dtype, **meta)
            q, k = qkv[:, :, :, :4].reshape(1024, 2, 32, head_dim), qkv[:, :, :, -2]
            for rotary_dim in (head_dim, head_dim // 2):
                angles = torch.empty(1024, 1, 1, rotary_dim, **meta)
                for interleaved in (False, True):
                    for backward in (False, True):
                        rp._launch(q, k, angles, interleaved, backward)
        # SwiGLU: Llama-3-8B's ffn per tp rank (14336 / 8) and a ragged width, with and without bias
        for width in (1792, 1000):
            h = torch.empty(4096, 2 * width, dtype=dtype, **meta)
            y = torch.empty(4096, width, dtype=dtype, **meta)
            for bias in (None, torch.empty(2 * width, dtype=dtype, **meta)):
                sg._launch(sg._swiglu_fwd_kernel, 4096, width, h, bias, y)
                sg._launch(sg._swiglu_bwd_kernel, 4096, width, h, bias, y, h)
    _moe_permute_cases()


def _moe_permute_cases():
    """The expert permutation at the GPU check's shapes (hidden 4096 and 2048, top-2/6/8 and capacity padding's
    all-expert slots), a hidden wider than one tile and a narrow one, int32 indices."""
    import torch

    from kernels import moe_permute as mp

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for hidden, k in ((4096, 2), (2048, 6), (2048, 8), (6144, 2), (40, 3), (2048, 64)):
            tokens = torch.empty(1024, hidden, dtype=dtype, device="meta")
            slots = torch.empty(1024, k, dtype=torch.int32, device="meta")
            index = torch.empty(1024 * k, dtype=torch.int32, device="meta")
            mp._gather_rows_triton(tokens, index)
            mp._sum_slots_triton(mp._gather_rows_triton(tokens, index), slots)


def _signature(kernel, args, kwargs):
    """Signature, constexprs and attrs as the JIT would specialise this launch."""
    import torch

    names = kernel.arg_names
    bound = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k in names})
    pointer_types = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int64: "*i64"}
    pointer_types[torch.int32] = "*i32"
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(names, kernel.params)):
        value = bound[name]
        if param.is_constexpr or value is None or (type(value) is int and value == 1):
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = pointer_types[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are at least 16-byte aligned
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: cannot type argument {name}={value!r}")
    options = {k: v for k, v in kwargs.items() if k not in names}
    return signature, constexprs, attrs, options


def _resource_usage(cubin):
    """{'REG': .., 'SHARED': .., 'LOCAL': .., 'STACK': ..} of the one function in a cubin, via cuobjdump."""
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in (item.split(":") for item in line.split() if ":" in item and item[-1].isdigit())}


def _compile_all():
    """Worker entry point: print one JSON line per distinct compiled configuration."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    from kernels import cross_entropy as ce
    from kernels import flash_attention as fa
    from kernels import moe_permute as mp
    from kernels import normalization as nm
    from kernels import rope as rp
    from kernels import swiglu as sg
    from kernels import triton_support

    assert not triton_support.INTERPRETER, "the compile worker must run with TRITON_INTERPRET=0"
    kernels = {
        name: obj
        for module in (fa, nm, ce, rp, sg, mp)
        for name, obj in vars(module).items()
        if isinstance(obj, JITFunction) and name.endswith("_kernel")
    }
    launches = []
    for kernel in kernels.values():
        kernel.run = lambda *args, grid, warmup, _k=kernel, **kw: launches.append((_k, args, kw))
    _launch_cases()

    seen = set()
    print(json.dumps({"kernels": sorted(kernels)}), flush=True)
    for kernel, args, kwargs in launches:
        signature, constexprs, attrs, options = _signature(kernel, args, kwargs)
        config = {
            "kernel": kernel.fn.__name__,
            "signature": signature,
            "options": options,
            "constexprs": {k: str(v) for k, v in constexprs.items()},
        }
        key = json.dumps(config, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        try:
            compiled = triton.compile(
                triton.compiler.ASTSource(kernel, signature, constexprs, attrs),
                target=GPUTarget("cuda", 90, 32),
                options=options,
            )
            config["shared"] = compiled.metadata.shared
            config["cubin_bytes"] = len(compiled.asm["cubin"])
            config["usage"] = _resource_usage(compiled.asm["cubin"])
        except Exception as exc:  # reported, and failed, by the test
            config["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        print(json.dumps(config), flush=True)


# ----------------------------------------------------------------------------- the test
def _describe(config):
    flags = ",".join(f"{k}={v}" for k, v in config["constexprs"].items() if v not in ("None",))
    return f"{config['kernel']}[{flags}] {config['options']}"


def test_every_kernel_configuration_compiles_for_sm90():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"compile worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    kernels, configs = lines[0]["kernels"], lines[1:]

    errors = [f"{_describe(c)}: {c['error']}" for c in configs if "error" in c]
    assert not errors, "\n\n".join(errors)
    assert set(kernels) == {c["kernel"] for c in configs}, "a kernel has no compiled configuration"
    for c in configs:
        print(
            f"{_describe(c):<120} shared={c['shared']:>6} regs={c['usage']['REG']:>3} "
            f"stack={c['usage'].get('STACK', 0)} local={c['usage'].get('LOCAL', 0)}"
        )
    too_big = [f"{_describe(c)}: {c['shared']} bytes" for c in configs if c["shared"] > SM90_MAX_SHARED_BYTES]
    assert not too_big, "shared memory above the SM90 limit:\n" + "\n".join(too_big)
    assert all(c["cubin_bytes"] > 0 for c in configs)
    spills = [
        f"{_describe(c)}: {c['usage']}"
        for c in configs
        if (c["usage"].get("STACK", 0) or c["usage"].get("LOCAL", 0)) and not _known_spill(c)
    ]
    assert not spills, "register spills:\n" + "\n".join(spills)


def _known_spill(config):
    """The norm backward at hidden 16384 (module docstring); and the RoPE kernel's stack frame, which is
    no spill: libdevice's accurate sinf/cosf keep a 28-byte array (`__local_depot` in the PTX) for the
    argument reduction of angles beyond about 1e5 radians, touched only then."""
    if config["kernel"] == "_rope_kernel":
        return config["usage"].get("LOCAL", 0) == 0 and config["usage"].get("STACK", 0) <= 64
    return config["kernel"] == "_norm_bwd_kernel" and config["constexprs"]["BLOCK_N"] == "16384"


if __name__ == "__main__":
    _compile_all()
