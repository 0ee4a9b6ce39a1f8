"""Tiny GPT and Llama runs under any layout, returning what equivalence tests compare."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel.schedules import ActionKind
from megatron.core.tensor_parallel.initialization import expert_tensors
from megatron.training.arguments.parser import GPT_DEFAULTS, LLAMA_DEFAULTS, parse_run_config
from megatron.training.trainer import Trainer

BASE = [
    "--num-layers",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "5",
    "--mock-data",
    "--vocab-size",
    "100",
    # Megatron pads the vocabulary to a multiple of this x tp and its softmax spans the padding, so
    # layouts compared with one process must pad alike: 100 -> 128 rows at tp 1, 2 and 4
    "--make-vocab-size-divisible-by",
    "32",
    "--lr",
    "3e-3",
    "--lr-warmup-iters",
    "1",
    "--lr-decay-style",
    "cosine",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]
MODELS = {
    "gpt": (GPT_DEFAULTS, ["--hidden-size", "32", "--num-attention-heads", "4"]),
    "llama": (
        LLAMA_DEFAULTS,
        [
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "8",
            "--group-query-attention",
            "--num-query-groups",
            "4",
            "--ffn-hidden-size",
            "96",
        ],
    ),
}


def model_flags(model: str, extra: list[str]) -> tuple[dict, list[str]]:
    defaults, flags = MODELS[model]
    return defaults, BASE + flags + list(extra)


def named_params(trainer: Trainer):
    for chunk in trainer.chunks:
        yield from chunk.module.named_parameters()


def seed_key(name: str, param) -> str:
    """The name under which the one-process model holds this parameter (tied copies map to the embedding)."""
    return param.init_spec.seed_name or name


def canonical_tensors(trainer: Trainer, tensor_of=torch.Tensor.detach) -> dict:
    """name -> (a copy of `tensor_of(param)`, InitSpec) of every tensor this rank holds, under the one-process
    model's names; grouped experts' weights are cut into the per-expert tensors they stand for."""
    return {
        name: (tensor.clone(), spec)
        for n, p in named_params(trainer)
        for name, tensor, spec in expert_tensors(seed_key(n, p), tensor_of(p), p.init_spec)
    }


def build_trainer(model: str, extra: list[str]) -> Trainer:
    defaults, argv = model_flags(model, extra)
    return Trainer(parse_run_config(argv, defaults, dist.get_world_size()), torch.device("cpu"))


def train(model: str, extra: list[str], iterations: int = 5, grads_at: int = 1) -> dict:
    """Train on this rank; return losses and grad norms per iteration, initial weights, gradients of
    iteration `grads_at` (whole only with the replicated optimizer: the distributed one keeps just
    this rank's shard of each reduced gradient; none where gradients are sharded, optim_grads),
    the weights after the last step, the bytes of optimizer state, the (parameter, gradient)
    bytes the buffers hold after the last step, and how many WEIGHT steps (split backward)
    this rank's schedule has, and FP8 delayed scaling's amax histories after iteration `grads_at`."""
    trainer = build_trainer(model, extra)
    trainer.optimizer.finish_param_sync()  # sharded parameters are kept as shards until first used
    initial = canonical_tensors(trainer)
    losses, grads, grad_norms, fp8_histories = [], {}, [], {}
    for iteration in range(1, iterations + 1):
        loss, *_ = trainer.forward_backward(iteration)
        if iteration == grads_at and not trainer.chunks[0].buffer.shards_grads:  # else no whole main_grad
            grads = canonical_tensors(trainer, lambda p: p.main_grad)
        if iteration == grads_at:  # FP8 delayed scaling: the amax history after this iteration
            fp8_histories = {
                n: b.clone() for c in trainer.chunks for n, b in c.module.named_buffers() if "fp8_amax_history" in n
            }
        grad_norms.append(trainer.optimizer.step().grad_norm)
        losses.append(loss)
    resident = [sum(values) for values in zip(*(chunk.buffer.resident_bytes() for chunk in trainer.chunks))]
    trainer.optimizer.finish_param_sync()
    final = canonical_tensors(trainer)
    return {
        "losses": losses,
        "initial": initial,
        "grads": grads,
        "grad_norms": grad_norms,
        "final": final,
        "optimizer_bytes": trainer.optimizer.state_bytes(),
        "resident_bytes": resident,
        "padded": sum(chunk.buffer.layout.numel for chunk in trainer.chunks),
        "weight_steps": sum(step[0].kind is ActionKind.WEIGHT for step in trainer.executor.steps),
        "fp8_histories": fp8_histories,
    }


def train_many(rank: int, runs: list[tuple]) -> list[dict]:
    """`train` of each (model, flags) or (model, flags, iterations)."""
    return [train(*run) for run in runs]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def shard(full: torch.Tensor, spec) -> torch.Tensor:
    """This layout's shard of a one-process tensor (the vocabulary padded alike: see BASE)."""
    assert tuple(full.shape) == tuple(spec.full_shape), f"{tuple(full.shape)} vs {tuple(spec.full_shape)}"
    return spec.shard.shard(full) if spec.shard is not None else full


def assert_losses_match(rank: int, out: dict, reference: dict) -> None:
    """One rank's losses of every iteration and iteration-1 grad norm equal the one-process run's (1e-5)."""
    for it, (loss, expected) in enumerate(zip(out["losses"], reference["losses"]), start=1):
        assert abs(loss - expected) <= 1e-5 * abs(expected), f"rank {rank} iteration {it}: {loss} vs {expected}"
    norm, expected_norm = out["grad_norms"][0], reference["grad_norms"][0]
    assert abs(norm - expected_norm) <= 1e-5 * expected_norm, f"rank {rank} grad norm: {norm} vs {expected_norm}"


def assert_final_weights_match(rank: int, out: dict, reference: dict, lr: float) -> None:
    """One rank's losses and first grad norm (`assert_losses_match`) and its parameters after the
    last step: within 1e-5 relative, plus 1e-3 of one step's `lr` per element for tensors whose
    gradient is rounding noise (GPT's key biases: softmax ignores them) that Adam amplifies."""
    assert_losses_match(rank, out, reference)
    for name, (weight, spec) in out["final"].items():
        expected = shard(reference["final"][name][0], spec)
        bound = 1e-5 * expected.norm() + 1e-3 * lr * weight.numel() ** 0.5
        assert (weight - expected).norm() <= bound, f"rank {rank} {name} after the last step"


def assert_matches_one_process(ranks: list[dict], reference: dict) -> None:
    """Every rank's `train` result against the one-process one: losses of every iteration, the
    iteration-1 grad norm and gradients (1e-5 relative), bit-identical initial weights, and every
    parameter of the model present in some rank."""
    for rank, out in enumerate(ranks):
        assert_losses_match(rank, out, reference)
    seen = set()
    for rank, out in enumerate(ranks):
        for name, (grad, spec) in out["grads"].items():
            expected = shard(reference["grads"][name][0], spec)
            assert grad.shape == expected.shape, f"rank {rank} {name}"
            assert relative_error(grad, expected) <= 1e-5, f"rank {rank} grad {name}"
            weight, _ = out["initial"][name]
            assert torch.equal(weight, shard(reference["initial"][name][0], spec)), f"rank {rank} init {name}"
            seen.add(name)
    assert seen == set(reference["grads"]), f"parameters missing from the layout: {set(reference['grads']) - seen}"


def assert_fp8_tracks_one_process(rank: int, out: dict, reference: dict) -> None:
    """An FP8 layout against the one-process FP8 run: iteration 1 (the same weights) gives its loss and grad
    norm to 1e-5; later iterations track it as bf16 layouts do (2e-3: an fp32 summation-order difference
    that moves a value across an FP8 rounding boundary changes it by up to 1/16); delayed scaling's amax
    histories after iteration 1 (in one process's units), where `out` has them, to 1e-5."""
    losses, expected = out["losses"], reference["losses"]
    assert abs(losses[0] - expected[0]) <= 1e-5 * expected[0], f"rank {rank} iteration 1: {losses[0]} vs {expected[0]}"
    norm, expected_norm = out["grad_norms"][0], reference["grad_norms"][0]
    assert abs(norm - expected_norm) <= 1e-5 * expected_norm, f"rank {rank} grad norm: {norm} vs {expected_norm}"
    for it, (loss, want) in enumerate(zip(losses, expected), start=1):
        assert abs(loss - want) <= 2e-3 * abs(want), f"rank {rank} iteration {it}: {loss} vs {want}"
    for name, history in out.get("fp8_histories", {}).items():
        want = reference["fp8_histories"][name]
        assert ((history - want).abs() <= 1e-5 * want).all(), f"rank {rank} {name}: {history} vs {want}"
