"""The Triton environment and the per-call choice between a Triton kernel and its torch reference.

`impl` is one of 'auto', 'triton', 'torch':
  * 'torch'  always runs the plain torch reference;
  * 'triton' runs the Triton kernel, on CUDA tensors, or on CPU tensors when the Triton
    interpreter is on (TRITON_INTERPRET=1 before triton is imported); anything else raises;
  * 'auto'   runs Triton when it can (triton importable, tensors on CUDA, shape and dtype
    supported by the kernel) and the torch reference otherwise.

The kernel modules build on this (jit, tl, output allocation, compute dtypes); which path each
op of a model takes is decided once, in kernels/dispatch.py. A shape-only call (fake tensors)
launches nothing, so it chooses as on its device with Triton installed.
"""

import os
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:  # Triton is optional: the torch references cover every op.
    triton = None

    class _NoTritonLanguage:
        """Stands in for triton.language so kernel modules still import (their signatures
        name `tl.constexpr`); their kernels are never launched without triton."""

        @staticmethod
        def constexpr(value=None):
            return value

    tl = _NoTritonLanguage()

    def jit(fn=None, **_options):
        return fn if fn is not None else (lambda f: f)


IMPLS = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HAS_TRITON = triton is not None
# The interpreter is chosen when `@triton.jit` runs, i.e. when our kernel modules are imported.
INTERPRETER = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def shape_only(t) -> bool:
    """True for fake tensors (shapes and dtypes, no data): kernels allocate their outputs and
    save for backward as on a real call, but launch nothing."""
    return is_fake(t)


def check_impl(impl):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _environment_reason(impl, device_type, assume_triton):
    """Why `impl` cannot run Triton on `device_type`, or None if it can. `assume_triton`: as if
    Triton were installed (on CPU: the interpreter on), for a run elsewhere or a shape-only call."""
    if not HAS_TRITON and not assume_triton:
        return "triton is not installed"
    if device_type == "cuda":
        return None
    if device_type != "cpu":
        return f"no Triton kernels for device type {device_type!r}"
    if impl == "auto":
        return "tensors on CPU"
    if INTERPRETER or assume_triton:
        return None
    return "tensors on CPU and TRITON_INTERPRET=1 was not set before importing triton"


@dataclass(frozen=True)
class OpPath:
    """One op's path: `impl` ('triton' or 'torch') is what the op is called with; `line` says why
    for the start-up log ('triton', 'triton (interpreter)', 'torch (tensors on CPU)', or
    'error (...)' where a forced Triton kernel cannot run: called with 'triton', it raises)."""

    impl: str
    line: str

    @property
    def error(self) -> str | None:
        return self.line[len("error (") : -1] if self.line.startswith("error") else None

    @property
    def runs_triton(self) -> bool:
        return self.impl == "triton" and self.error is None


def op_path(impl, device_type, unsupported=None, assume_triton=False) -> OpPath:
    """Resolve `impl` for one op on `device_type`. `unsupported` is the kernel's own reason it cannot
    take these inputs (a head dim, a dtype, a hidden size), or None. 'auto' falls back to torch on
    any reason; 'triton' stays 'triton' with an error line."""
    check_impl(impl)
    if impl == "torch":
        return OpPath("torch", "torch (impl='torch')")
    reason = _environment_reason(impl, device_type, assume_triton) or unsupported
    if reason is not None:
        return OpPath("torch", f"torch ({reason})") if impl == "auto" else OpPath("triton", f"error ({reason})")
    return OpPath("triton", "triton (interpreter)" if device_type == "cpu" else "triton")


def use_triton(impl, t, unsupported=None):
    """Resolve `impl` for one call on tensor `t`: True to run the Triton kernel, False for the torch
    reference. A shape-only `t` launches nothing, so it chooses as on its device with Triton
    installed. 'triton' raises where it cannot run: RuntimeError when the environment cannot run
    Triton, ValueError when the inputs are unsupported."""
    check_impl(impl)
    if impl == "torch":
        return False
    env_reason = _environment_reason(impl, t.device.type, shape_only(t))
    if impl == "auto":
        return env_reason is None and unsupported is None
    if env_reason is not None:
        raise RuntimeError(f"impl='triton' cannot run: {env_reason}")
    if unsupported is not None:
        raise ValueError(unsupported)
    return True


def kernel_path(impl, device, unsupported=None):
    """One line for the start-up log saying which path a call with `impl` on `device` takes,
    e.g. 'triton', 'triton (interpreter)', 'torch (tensors on CPU)'."""
    return op_path(impl, torch.device(device).type, unsupported).line


def empty(shape, dtype, device):
    """Allocator for every kernel output; tests replace it with a NaN-filled one."""
    return torch.empty(shape, dtype=dtype, device=device)


def compute_dtype(dtype):
    """Triton dtype that loaded tiles are converted to before arithmetic.

    The CPU interpreter computes `tl.dot` on bf16 tiles wrongly, so there bf16 is upcast to
    fp32; on a GPU the tiles stay in their storage dtype and feed the tensor cores.
    """
    if INTERPRETER and dtype == torch.bfloat16:
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def dot_precision(dtype):
    """fp32 tiles use exact fp32 products ('ieee'); the default on GPUs would be TF32."""
    return "ieee" if compute_dtype(dtype) == tl.float32 else "tf32"
