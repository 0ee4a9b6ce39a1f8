"""Training behaviour: seeds, mixed precision, the fp16 loss scaler, recomputation, tied embeddings,
host reads between log lines, sent pipeline outputs released, and the CLI end to end (torchrun with
4 ranks prints the one-rank losses)."""

from __future__ import annotations

import contextlib
import re
import sys

import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel.schedules import ActionKind
from megatron.training.arguments.parser import parse_run_config
from megatron.training.iteration_log import IterationLog
from megatron.training.trainer import Trainer, timed_step
from tests.cli import TINY_LLAMA, explain, printed_losses, run_cli
from tests.distributed import run_distributed
from tests.parallel.layouts import model_flags, named_params, train


def _trainer(model, extra):
    defaults, argv = model_flags(model, extra)
    return Trainer(parse_run_config(argv, defaults, dist.get_world_size()), torch.device("cpu"))


def _weights(trainer):
    return {n: p.detach().clone() for n, p in named_params(trainer)}


def check_seed_changes_weights():
    a, b = _weights(_trainer("llama", [])), _weights(_trainer("llama", ["--seed", "7"]))
    assert all(not torch.equal(a[n], b[n]) for n in a if a[n].std() > 0), "a new --seed must change random weights"


def check_low_precision_trains(precision):
    # fp16 starts from a moderate scale: from the default 2**32 the dynamic scaler skips ~30 iterations first
    scale = ["--initial-loss-scale", "4096"] if precision == "--fp16" else []
    trainer = _trainer("llama", [precision, "--lr", "1e-2", "--train-iters", "20"] + scale)
    assert all(
        p.dtype == (torch.bfloat16 if precision == "--bf16" else torch.float16) for _, p in named_params(trainer)
    )
    losses = [trainer.train_step(i).loss for i in range(1, 21)]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, f"{precision} loss did not fall: {losses}"


def check_fp16_scaler_skips_injected_inf():
    trainer = _trainer("gpt", ["--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1"])
    before = _weights(trainer)
    trainer.forward_backward(1)
    next(iter(named_params(trainer)))[1].main_grad.view(-1)[0] = float("inf")
    result = trainer.optimizer.step()
    assert result.skipped and trainer.optimizer.loss_scale == 512.0
    after = _weights(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before), "a skipped step must not change weights"
    assert not trainer.train_step(2).skipped


def check_recompute_replays():
    """Recomputation (with dropout on) gives the losses and gradients of storing activations."""
    dropout = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
    variants = [
        [],
        ["--recompute-granularity", "selective"],
        ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
        ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"],
    ]
    results = [train("gpt", dropout + v, iterations=2) for v in variants]
    for variant, result in zip(variants[1:], results[1:]):
        assert result["losses"] == results[0]["losses"], variant
        for name, (grad, _) in result["grads"].items():
            assert torch.equal(grad, results[0]["grads"][name][0]), f"{variant} {name}"


HOST_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def counting_host_reads():
    """Yields the list of functions that read a tensor's value on the host, as they do."""
    reads, originals = [], {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(original):
        def read(self, *args, **kwargs):
            reads.append(sys._getframe(1).f_code.co_name)
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(original))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def check_iterations_between_log_lines_read_only_the_grad_norm():
    """Between log lines an iteration reads one number on the host, the global gradient norm
    (the update needs it: clipping, skipping a non-finite step). The loss sums, the token
    count, the step's timeline and the skipped/nan counts stay on the device until a line."""
    trainer = _trainer("gpt", ["--bf16", "--log-interval", "3"])
    lines = []
    log = IterationLog(trainer, lines.append, first_iteration=1)
    for iteration in range(1, 4):
        with counting_host_reads() as reads:
            log.report(iteration, *timed_step(trainer, iteration))
        if iteration == 2:
            assert reads == ["global_grad_norm"], reads
    assert [int(re.search(r"iteration +(\d+)/", line).group(1)) for line in lines if " iteration " in line] == [1, 3]


def single_rank_checks(rank):
    check_seed_changes_weights()
    check_low_precision_trains("--bf16")
    check_low_precision_trains("--fp16")
    check_fp16_scaler_skips_injected_inf()
    check_recompute_replays()
    check_iterations_between_log_lines_read_only_the_grad_norm()
    return True


def _watch_sent_outputs(executor) -> list[int]:
    """Bytes the executor still holds of each output right after posting its send (filled as it runs)."""
    held, post = [], executor._post

    def post_and_look(step, transfers, inputs, outputs, *rest):
        post(step, transfers, inputs, outputs, *rest)
        sent = [(a.microbatch, a.chunk) for a in step if a.kind is ActionKind.SEND_FORWARD]
        held.extend(outputs[key].untyped_storage().nbytes() for key in sent)

    executor._post = post_and_look
    return held


def pipeline_run(rank):
    trainer = _trainer("gpt", ["--pipeline-model-parallel-size", "2"])
    held = _watch_sent_outputs(trainer.executor)
    for iteration in range(1, 4):
        trainer.train_step(iteration)
    module = trainer.chunks[0].module
    weight = module.embedding.word_embeddings.weight if rank == 0 else module.output_layer.weight
    return weight.detach().clone(), held


def test_single_rank_training_behaviour():
    assert run_distributed(1, single_rank_checks) == [True]


def test_tied_embeddings_stay_identical_and_sent_outputs_are_released():
    (first, sent), (last, _) = run_distributed(2, pipeline_run)
    assert torch.equal(first, last)
    assert len(sent) == 3 * 4, sent  # 4 microbatches a step, each output sent...
    assert max(sent) <= 4, f"bytes of sent outputs still held by the executor: {sent}"  # ...and let go


def test_cli_torchrun_matches_one_rank():
    one = run_cli("pretrain_llama.py", TINY_LLAMA)
    four = run_cli(
        "pretrain_llama.py", TINY_LLAMA + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], nproc=4
    )
    assert one.returncode == 0, explain(one)
    assert four.returncode == 0, explain(four)
    assert len(printed_losses(one.stdout)) == 5 and printed_losses(four.stdout) == printed_losses(one.stdout)
    assert "throughput per GPU (TFLOP/s/GPU)" in four.stdout and "number of nan iterations:   0 |" in four.stdout
