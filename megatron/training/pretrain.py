"""Entry point shared by pretrain_gpt.py and pretrain_llama.py, and the training loop (`train`) it runs:
iterations of the Trainer with logging, profiling, saves, validation and the exit conditions."""

from __future__ import annotations

import os
import sys
import traceback
from typing import NoReturn

import torch
import torch.distributed as dist

from megatron.core.errors import AgreedError
from megatron.core.fp8.gemm import refuse_device_without_fp8
from megatron.core.fp8.gemm import startup_line as fp8_startup_line
from megatron.training.arguments.errors import EXPECTED_ERRORS, report_error
from megatron.training.arguments.parser import parse_run_config
from megatron.training.evaluation import Validation
from megatron.training.heartbeat import Heartbeat
from megatron.training.initialize import (
    check_torch_version,
    choose_backend,
    init_distributed,
    launch_environment,
    select_device,
)
from megatron.training.iteration_log import IterationLog
from megatron.training.kernel_paths import startup_kernel_paths
from megatron.training.memory_check import check_memory, check_offload_budget
from megatron.training.profiling import IterationProfiler
from megatron.training.run_control import RunControl
from megatron.training.trainer import Trainer, timed_step


def _precision(run) -> str:
    if run.optimizer.bf16:
        return "bf16 weights, fp32 master weights and gradient reduction"
    if run.optimizer.fp16:
        scaler = (
            f"constant loss scale {run.optimizer.loss_scale}" if run.optimizer.loss_scale else "dynamic loss scaling"
        )
        return f"fp16 weights, fp32 master weights and gradient reduction, {scaler}"
    return "fp32"


def startup_summary(trainer: Trainer, backend: str, paths: dict) -> list[str]:
    run, mesh = trainer.run, trainer.mesh
    model = run.model
    lines = [
        f"> layout: {mesh.dims.describe()}, virtual stages per pipeline rank {run.parallel.virtual_stages}, "
        f"backend {backend}, device {trainer.device.type}",
        f"> model: {model.num_layers} layers, hidden {model.hidden_size}, ffn {model.ffn_hidden_size}, "
        f"heads {model.num_attention_heads} (query groups {model.num_query_groups}), seq {model.seq_length}, "
        f"vocab {model.vocab_size} (padded {model.padded_vocab_size}), {model.normalization}, "
        f"{model.position_embedding_type} positions, {'SwiGLU' if model.swiglu else 'GELU'} MLP",
        f"> precision: {_precision(run)}",
        f"> batch: micro {run.training.micro_batch_size} x dp {mesh.dp_size} x "
        f"{run.training.num_microbatches} microbatches = global {run.training.global_batch_size}",
        f"> kernels: {'; '.join(f'{op} {path}' for op, path in paths.items())}; "
        "NVIDIA apex not used (optional; nothing here needs it)",
    ]
    if not run.training.batch_schedule.constant:
        lines.append(
            f"> batch size grows: {run.training.batch_schedule.sizes()} (--rampup-batch-size / "
            f"--step-batch-size-schedule), {run.training.train_iters} iterations"
        )
    if model.fp8 is not None:
        lines.append(fp8_startup_line(model.fp8, trainer.device))
    if run.training.deterministic:
        lines.append("> --deterministic-mode: torch.use_deterministic_algorithms(True)")
    if run.sequence_parallel_requested and not model.sequence_parallel:
        lines.append("> note: --sequence-parallel has no effect with --tensor-model-parallel-size 1")
    return lines + run.notes


def _gather_parameter_counts(trainer: Trainer) -> list[int]:
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, trainer.parameters_on_rank())
    return counts


def _optimizer_state_line(trainer: Trainer) -> str:
    """Optimizer state bytes of every rank, counted from the tensors (a collective: call on all
    ranks), and this rank's bytes per parameter beside the unpadded figure: fp32 master copies of
    low-precision weights (4) + Adam moments (8), divided over dp x cp with the distributed optimizer."""
    state = [None] * dist.get_world_size()
    dist.all_gather_object(state, trainer.optimizer.state_bytes())
    mesh, ddp = trainer.mesh, trainer.run.parallel.ddp
    shards = mesh.dp_size * mesh.cp_size if ddp.use_distributed_optimizer else 1
    full = 8 + (0 if trainer.run.model.params_dtype == torch.float32 else 4)
    how = f"sharded over dp x cp = {shards}" if ddp.use_distributed_optimizer else "replicated"
    line = (
        f"> optimizer state per rank (rank order, bytes, {how}): {state}; this rank "
        f"{state[dist.get_rank()] / trainer.parameters_on_rank():.3f} bytes per parameter "
        f"({full}/{shards} = {full / shards:.3f} plus bucket padding)"
    )
    if ddp.sharding_strategy not in ("no_shard", "optim"):
        weights, grads = (
            sum(size) for size in zip(*(b.kept_bytes() for chunk in trainer.chunks for b in chunk.buffers))
        )
        kept = "weights and gradients" if ddp.sharding_strategy == "optim_grads_params" else "gradients"
        line += (
            f"\n> sharding strategy {ddp.sharding_strategy}: {kept} kept as shards over dp x cp = {shards}; "
            f"this rank keeps weights {weights} bytes, gradients {grads} bytes between steps"
            + (
                "; parameters stay gathered from a microbatch's forward to its backward (pipeline parallelism)"
                if ddp.sharding_strategy == "optim_grads_params" and not ddp.reshard_after_forward
                else ""
            )
        )
    return line


def train(trainer: Trainer, emit, start_iteration: int = 0, log_window: dict | None = None) -> None:
    """`log_window`: the open averaging window of the log line, as the loaded checkpoint stored it."""
    run = trainer.run
    training = run.training
    log = IterationLog(trainer, emit, first_iteration=start_iteration + 1, window=log_window)
    profiler = IterationProfiler(run.logging, dist.get_rank(), trainer.device)
    saver = None
    if run.checkpoint.save:
        from megatron.training.checkpoint import CheckpointSaver  # see _checkpoint_to_load

        saver = CheckpointSaver(run.checkpoint.save, trainer, emit, run.checkpoint.async_save, log.window_state)
    control = RunControl(run.checkpoint, saver.save if saver is not None else None, trainer.device)
    validation = Validation(trainer, emit, log)
    iteration = start_iteration
    try:
        for iteration in range(start_iteration + 1, (0 if run.evaluation.skip_train else training.train_iters) + 1):
            profiler.before(iteration)
            result, elapsed = timed_step(trainer, iteration)
            trace = profiler.after(iteration)
            if trace:
                print(f"> rank {dist.get_rank()}: profiler trace written to {trace}", flush=True)
            if saver is not None:
                saver.poll()  # finalizes a background save once every rank has written it
            stop = control.stop_reason(iteration)
            log.report(iteration, result, elapsed, force=iteration == training.train_iters or stop is not None)
            control.save_if_due(iteration, training.train_iters, stop)  # with the log's open window
            if iteration % run.evaluation.interval == 0 and iteration != training.train_iters:
                validation.run(iteration)
            if stop is not None:
                emit(f"> exiting after iteration {iteration}: {stop}")
                break
        else:
            validation.at_end(iteration)
        if saver is not None:
            saver.finish()  # a background save completes before the run ends
    finally:
        profiler.stop()
        log.close()


def _validate(argv, defaults, world_size: int, local_rank: int, prog):
    """Everything that can be refused before any process group exists: the command line,
    the backend, forced kernel paths and the memory estimate. Raises ValueError (one line)."""
    check_torch_version()
    run = parse_run_config(argv, defaults, world_size, prog)
    device = select_device(local_rank)
    if run.model.fp8 is not None:
        refuse_device_without_fp8(device)
    backend = choose_backend(run.parallel.backend, device)
    paths = startup_kernel_paths(
        run.model, device, document_mask=run.data is not None and run.data.reset_attention_mask
    )
    check_offload_budget(run, device)
    memory_lines = check_memory(
        run, device, run.training.device_memory_gb, run.training.skip_memory_check, run.training.host_memory_gb
    )
    return run, device, backend, paths, memory_lines, _checkpoint_to_load(run)


def _checkpoint_to_load(run):
    """The checkpoint --load names (None without --load). The checkpoint package is imported only by
    a run that saves or loads: torch.distributed.checkpoint, under it, takes 0.5-0.9 s to import on
    every rank."""
    if run.checkpoint.load is None:
        return None
    from megatron.training.checkpoint import checkpoint_to_load

    return checkpoint_to_load(run)


def _train_from(validated: tuple, rank: int, world_size: int, backend: str) -> int:
    """Build the model on every rank, load the checkpoint, train. Expected errors propagate."""
    run, device, _, paths, memory_lines, checkpoint = validated
    trainer = Trainer(run, device)
    counts = _gather_parameter_counts(trainer)
    state_line = _optimizer_state_line(trainer)
    if rank == world_size - 1:
        for line in startup_summary(trainer, backend, paths) + memory_lines:
            print(line, flush=True)
        print(f"> parameters per rank (rank order): {counts}", flush=True)
        print(state_line, flush=True)
    emit = (lambda line: print(line, flush=True)) if rank == world_size - 1 else (lambda line: None)
    start_iteration, log_window = 0, None
    if checkpoint is not None:
        from megatron.training.checkpoint import load_checkpoint  # see _checkpoint_to_load

        start_iteration, notes = load_checkpoint(checkpoint, trainer, run.checkpoint)
        log_window = checkpoint.metadata.get("log_window") if start_iteration else None
        for line in notes:
            emit(line)
    try:
        train(trainer, emit=emit, start_iteration=start_iteration, log_window=log_window)
    finally:
        trainer.close()
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    return 0


def _failure(error: BaseException) -> str:
    """What the heartbeat tells the peers of this rank's failure (one short line)."""
    return f"failed: {type(error).__name__}: {(str(error) or '-').splitlines()[0][:200]}"


def _end_failed_rank(heartbeat: Heartbeat, error: BaseException, exit_code: int) -> NoReturn:
    """A rank that failed, its error printed, while its peers may be gone: tell them through the
    heartbeat (they exit at once instead of a heartbeat timeout later), then end without tearing the
    process group down. With a collective of this rank pending on a peer that went silent (a node
    without power sends no reset), gloo's destroy_process_group, and the interpreter's exit, wait for
    that collective: the process group's timeout, 10 minutes by default."""
    heartbeat.report_failure(_failure(error))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def main(defaults: dict, argv: list[str] | None = None, prog: str | None = None) -> int:
    """Exit status 0, or 2 with one error line for an expected error (megatron.training.arguments.errors)."""
    rank, world_size, local_rank = launch_environment()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    try:
        validated = _validate(sys.argv[1:] if argv is None else argv, defaults, world_size, local_rank, prog)
    except EXPECTED_ERRORS as error:  # the same on every rank: nothing differs between them yet
        return report_error(error, rank, on_every_rank=True)
    run, device, backend = validated[:3]
    init_distributed(backend, run.parallel.timeout_minutes, device)
    heartbeat = Heartbeat.start(run.parallel.heartbeat_timeout, rank, world_size)
    if run.training.deterministic:
        torch.use_deterministic_algorithms(True)
    try:
        return _train_from(validated, rank, world_size, backend)
    except EXPECTED_ERRORS as error:
        if heartbeat is not None and not isinstance(error, AgreedError):  # the peers would wait for this rank
            _end_failed_rank(heartbeat, error, report_error(error, rank))
        return report_error(error, rank)
    except BaseException as error:
        if heartbeat is not None:
            traceback.print_exc()
            _end_failed_rank(heartbeat, error, 1)
        raise
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        dist.destroy_process_group()
