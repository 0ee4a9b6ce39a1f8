"""The transformer layers run the Triton kernels (interpreter on CPU) and reproduce the torch path."""

from __future__ import annotations

from tests.distributed import run_distributed
from tests.parallel.layouts import train

KERNEL_FRIENDLY = ["--num-layers", "2", "--kv-channels", "64", "--seq-length", "16"]


def triton_vs_torch(rank):
    out = {}
    for impl in ("torch", "triton"):
        flags = KERNEL_FRIENDLY + ["--kernel-impl", impl]  # attention, norms, RoPE, SwiGLU
        out[impl] = train("llama", flags, iterations=2)
    return out


def test_triton_kernels_reproduce_torch_path_in_training():
    result = run_distributed(1, triton_vs_torch)[0]
    reference, kernels = result["torch"], result["triton"]
    for ours, expected in zip(kernels["losses"], reference["losses"]):
        assert abs(ours - expected) <= 1e-5 * abs(expected)
    for name, (grad, _) in kernels["grads"].items():
        expected = reference["grads"][name][0]
        assert ((grad - expected).norm() / expected.norm()).item() <= 1e-4, name
