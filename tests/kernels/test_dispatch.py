"""kernels/dispatch.py's rule (an op's own switch, then --kernel-impl), the flags that set it, and the
start-up check that names the flag forcing a Triton path that cannot run."""

import dataclasses

import pytest
import torch

from kernels import triton_support
from kernels.dispatch import kernel_paths
from megatron.training.arguments.parser import LLAMA_DEFAULTS, parse_run_config
from megatron.training.kernel_paths import startup_kernel_paths

LLAMA = [
    *("--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "2", "--seq-length", "16"),
    *("--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--mock-data"),
    *("--vocab-size", "100", "--attention-dropout", "0", "--bf16"),
]


def model(*flags):
    return parse_run_config(LLAMA + list(flags), LLAMA_DEFAULTS, 1).model


def sides(paths):
    return {op: getattr(paths, op).impl for op in ("attention_kernel", "norm", "rope", "swiglu")}


def test_flags_set_each_ops_switch_and_megatron_defaults_fuse():
    default = model()
    assert (default.rope_impl, default.swiglu_impl, default.kernel_impl) == ("auto", "auto", "auto")
    unfused = model("--no-rope-fusion", "--no-bias-swiglu-fusion", "--kernel-impl", "triton")
    assert (unfused.rope_impl, unfused.swiglu_impl, unfused.kernel_impl) == ("torch", "torch", "triton")
    assert model("--no-rope-fusion", "--apply-rope-fusion").rope_impl == "auto"  # the last one wins
    notes = parse_run_config(LLAMA + ["--no-rope-fusion"], LLAMA_DEFAULTS, 1).notes
    assert not any("--no-rope-fusion" in note for note in notes)  # no longer a no-op


def test_auto_runs_triton_on_cuda_and_torch_on_cpu():
    config = model()
    assert set(sides(config.kernel_paths("cuda", assume_triton=True)).values()) == {"triton"}
    cpu = config.kernel_paths("cpu")
    assert set(sides(cpu).values()) == {"torch"} and cpu.rope.line == "torch (tensors on CPU)"


def test_own_switch_wins_over_kernel_impl():
    forced_torch = model("--kernel-impl", "torch", "--normalization-impl", "triton")
    paths = forced_torch.kernel_paths("cuda", assume_triton=True)
    assert sides(paths) == {"attention_kernel": "torch", "norm": "triton", "rope": "torch", "swiglu": "torch"}
    forced_triton = model("--kernel-impl", "triton", "--no-rope-fusion", "--attention-backend", "torch")
    paths = forced_triton.kernel_paths("cpu")
    assert sides(paths) == {"attention_kernel": "torch", "norm": "triton", "rope": "torch", "swiglu": "triton"}


def test_kernel_impl_triton_forces_only_where_the_kernel_takes_the_shape():
    """An fp32 CUDA model: no attention kernel there (its reason logged), the others run; a rotary dim
    the RoPE kernel does not take (odd: the config refuses it, the kernel's rule says it too)."""
    config = dataclasses.replace(model("--kernel-impl", "triton"), params_dtype=torch.float32)
    paths = config.kernel_paths("cuda", assume_triton=True)
    assert sides(paths) == {"attention_kernel": "torch", "norm": "triton", "rope": "triton", "swiglu": "triton"}
    assert "fp16 and bf16" in paths.attention_kernel.line
    shape = dict(attention_impl="auto", norm_impl="auto", head_dim=128, hidden_size=256, dtype=torch.bfloat16)
    odd = kernel_paths("cuda", kernel_impl="triton", rotary_dim=5, assume_triton=True, **shape)
    assert odd.rope.line == "torch (rotary dim 5 (must be even and at most the head dim 128))"
    assert kernel_paths("cuda", rope_impl="triton", rotary_dim=5, assume_triton=True, **shape).rope.error


def test_startup_names_the_flag_that_forced_triton(monkeypatch):
    monkeypatch.setattr(triton_support, "INTERPRETER", False)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"^--kernel-impl triton cannot run: tensors on CPU and TRITON_INTERPRET"):
        startup_kernel_paths(model("--kernel-impl", "triton", "--attention-backend", "torch"), cpu)
    with pytest.raises(ValueError, match=r"^--normalization-impl triton cannot run"):
        startup_kernel_paths(model("--normalization-impl", "triton"), cpu)
    paths = startup_kernel_paths(model(), cpu)
    assert list(paths) == ["attention", "normalization", "rope", "swiglu", "lm head + cross entropy"]
    assert paths["swiglu"] == "torch (tensors on CPU)"


def test_fp8_casts_follow_kernel_impl():
    """FP8 linear layers' casts (kernels/fp8_cast.py): Triton on CUDA by default, torch on CPU unless forced;
    the start-up log names their path; a model without FP8 has none."""
    assert model().kernel_paths("cuda", assume_triton=True).fp8_cast is None
    fp8 = model("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")
    assert fp8.kernel_paths("cuda", assume_triton=True).fp8_cast.impl == "triton"
    assert fp8.kernel_paths("cpu").fp8_cast.line == "torch (tensors on CPU)"
    forced = model("--fp8-format", "hybrid", "--kernel-impl", "triton", "--attention-backend", "torch")
    assert forced.kernel_paths("cpu").fp8_cast.line == "triton (interpreter)"
    assert startup_kernel_paths(forced, torch.device("cpu"))["fp8 casts"] == "triton (interpreter)"
    assert model("--fp8-format", "hybrid", "--kernel-impl", "torch").kernel_paths("cuda").fp8_cast.impl == "torch"
