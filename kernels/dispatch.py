"""Choosing between a Triton kernel and its torch reference, shared by every kernel module.

`impl` is one of 'auto', 'triton', 'torch':
  * 'torch'  always runs the plain torch reference;
  * 'triton' runs the Triton kernel, on CUDA tensors, or on CPU tensors when the Triton
    interpreter is on (TRITON_INTERPRET=1 before triton is imported); anything else raises;
  * 'auto'   runs Triton when it can (triton importable, tensors on CUDA, shape and dtype
    supported by the kernel) and the torch reference otherwise.
"""

import contextlib
import os

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


_estimated_device_type = None  # set by `estimating_for` while the memory estimator traces a run


@contextlib.contextmanager
def estimating_for(device_type):
    """Within: calls on shape-only tensors choose their path as they would on `device_type`
    with Triton installed (on CPU: with the interpreter on). The memory estimator traces runs
    with fake CPU tensors, so that each op saves for backward what it saves on the device the
    estimate is for, whether or not this process could launch the kernel."""
    global _estimated_device_type
    saved, _estimated_device_type = _estimated_device_type, device_type
    try:
        yield
    finally:
        _estimated_device_type = saved


def device_of(t):
    """The device a kernel call on `t` dispatches for (see `estimating_for`)."""
    return torch.device(_estimated_device_type) if _estimated_device_type and is_fake(t) else t.device


def shape_only(t) -> bool:
    """True for fake tensors (shapes and dtypes, no data): kernels allocate their outputs and
    save for backward as on a real call, but launch nothing."""
    return is_fake(t)


def check_impl(impl):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _environment_reason(impl, device):
    """Why `impl` cannot run Triton on `device`, or None if it can."""
    estimating = _estimated_device_type is not None  # a shape-only trace: as if Triton could run
    if not HAS_TRITON and not estimating:
        return "triton is not installed"
    kind = torch.device(device).type
    if kind == "cuda":
        return None
    if kind != "cpu":
        return f"no Triton kernels for device type {kind!r}"
    if impl == "auto":
        return "tensors on CPU"
    if INTERPRETER or estimating:
        return None
    return "tensors on CPU and TRITON_INTERPRET=1 was not set before importing triton"


def use_triton(impl, device, unsupported=None):
    """Resolve `impl` for one call: True to run the Triton kernel, False for the torch reference.

    `unsupported` is the kernel's own reason it cannot take these inputs (a head dim, a dtype,
    a hidden size), or None. 'auto' falls back to torch on any reason; 'triton' raises:
    RuntimeError when the environment cannot run Triton, ValueError when the inputs are unsupported.
    """
    check_impl(impl)
    if impl == "torch":
        return False
    env_reason = _environment_reason(impl, device)
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
    check_impl(impl)
    if impl == "torch":
        return "torch (impl='torch')"
    reason = _environment_reason(impl, device) or unsupported
    if reason is not None:
        return f"torch ({reason})" if impl == "auto" else f"error ({reason})"
    return "triton (interpreter)" if torch.device(device).type == "cpu" else "triton"


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
