"""The trainer: this rank's model chunks, buffers, optimizer and data, and one training iteration of them
(the loop that repeats it is `pretrain.train`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from megatron.core.distributed.finalize import finalize_model_grads
from megatron.core.distributed.host_chunks import HostChunks
from megatron.core.distributed.model_chunk_buffers import ModelChunkBuffers, chunk_layouts
from megatron.core.fp8.delayed import update_delayed_scaling
from megatron.core.fp8.gemm import refuse_device_without_fp8
from megatron.core.models.stages import build_model_chunks
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
from megatron.core.parallel_state import ParallelMesh
from megatron.core.pipeline_parallel.executor import PipelineExecutor, PipelineSpec, StepStats, reduced_token_mean
from megatron.core.pipeline_parallel.forward_only import ForwardOnlyExecutor
from megatron.core.tensor_parallel.initialization import deferred_initialization, is_deferred
from megatron.core.transformer.moe.aux_losses import reduced_aux_losses, set_aux_loss_scale
from megatron.core.transformer.moe.router import update_expert_biases
from megatron.data.batches import model_input_fields
from megatron.training.batch_loader import BatchLoader
from megatron.training.datasets import build_run_datasets
from megatron.training.offload_run import keep_gathered_buckets, place_chunks


@dataclass
class IterationResult:
    """One iteration's figures. The mean loss stays a device tensor and the pipeline timeline
    is read only on demand, so producing a result makes the host wait for nothing; `loss`
    and `idle_fraction` read them."""

    mean_loss: torch.Tensor
    grad_norm: float | None
    skipped: bool
    lr: float
    loss_scale: float
    stats: StepStats
    data_wait: float = 0.0  # seconds this rank waited for its batches
    moe_losses: dict = field(default_factory=dict)  # Megatron's logged MoE losses (device tensors, last rank)

    @property
    def loss(self) -> float:
        return self.mean_loss.item()

    @property
    def idle_fraction(self) -> float:
        return self.stats.idle_fraction


class Trainer:
    """Everything one rank needs to train: mesh, model chunks, optimizer, data, executor."""

    def __init__(self, run, device: torch.device):
        self.run, self.device = run, device
        model_cfg, parallel, training = run.model, run.parallel, run.training
        if model_cfg.fp8 is not None:
            refuse_device_without_fp8(device)
        self.mesh = ParallelMesh(parallel.dims, device.type)
        torch.manual_seed(training.seed)  # dropout uses each model chunk's own streams (RNGTracker)
        with deferred_initialization():  # each parameter is initialised in its buffer (a shard at a time)
            modules = build_model_chunks(
                model_cfg,
                self.mesh,
                parallel.virtual_stages,
                training.seed,
                device,
                parallel.first_stage_layers,
                parallel.last_stage_layers,
                parallel.placement.kind,
            )
        eager = [name for module in modules for name, p in module.named_parameters() if not is_deferred(p)]
        if eager:  # it would keep the value it was built with, not its InitSpec's
            raise ValueError(f"{eager[0]}: a parameter not made by make_param cannot be initialised in its buffer")
        groups = (self.mesh.dp_cp_group, self.mesh.edp_group)
        self.placement_decision = None  # --offload-policy auto: what it chose and why
        host = None
        if run.optimizer.offload.enabled:  # placed first: host-resident shards are made on host
            layouts = [layout for m in modules for layout in chunk_layouts(m, parallel.ddp, *groups)]
            placement, self.placement_decision = place_chunks(run, self.mesh.pp_rank, layouts, device)
            host = HostChunks(layouts, placement, model_cfg.params_dtype, device)
        reducing: list = []  # one gradient reduction in flight per rank, whichever chunk it is of
        self.chunks = [
            ModelChunkBuffers(m, parallel.ddp, groups[0], training.seed, groups[1], host=host, reducing=reducing)
            for m in modules
        ]
        if host is not None:
            keep_gathered_buckets(self.chunks, self.placement_decision, parallel.pp)
        self.optimizer = MixedPrecisionOptimizer(self.chunks, run.optimizer, self.mesh, host)
        s = model_cfg.seq_length // parallel.cp // (parallel.tp if model_cfg.sequence_parallel else 1)
        model_inputs = model_input_fields(run.data)
        self._spec = PipelineSpec(
            p2p_shape=(s, training.micro_batch_size, model_cfg.hidden_size),
            p2p_dtype=model_cfg.params_dtype,
            num_microbatches=training.num_microbatches,
            group_size=parallel.microbatch_group_size,
            every_stage_reads=bool(model_inputs),
            split_backward=parallel.split_backward,
            schedule=parallel.pipeline_schedule,
        )
        self.executor = PipelineExecutor(self.chunks, self.mesh, self._spec)
        self._executors = {training.num_microbatches: self.executor}  # one per batch size of the schedule
        self.forward_only = ForwardOnlyExecutor(
            self.chunks,
            self.mesh,
            self._spec.p2p_shape,
            model_cfg.params_dtype,
            training.num_microbatches,
            bool(model_inputs),
            parallel.pipeline_schedule,
        )
        self.datasets = dict(zip(("train", "valid", "test"), build_run_datasets(run)))
        workers = run.data.num_workers if run.data is not None else 1
        m = training.num_microbatches
        self.loaders = {
            "train": BatchLoader(
                self.datasets["train"],
                device,
                self.mesh,
                training.micro_batch_size,
                self._train_plan,
                workers,
                model_inputs,
            )
        }
        for split in ("valid", "test"):
            if self.datasets[split] is not None:
                self.loaders[split] = BatchLoader(
                    self.datasets[split],
                    device,
                    self.mesh,
                    training.micro_batch_size,
                    lambda k: (k * training.global_batch_size, m),
                    workers,
                    model_inputs,
                )

    @property
    def dataset(self):
        return self.datasets["train"]

    @dataset.setter
    def dataset(self, dataset) -> None:
        """Replace the training data (tests feed special masks this way)."""
        self.datasets["train"] = self.loaders["train"].dataset = dataset

    def _train_plan(self, iteration: int) -> tuple[int, int]:
        """(samples consumed before `iteration`, its microbatches per dp rank)."""
        schedule = self.run.training.batch_schedule
        consumed = schedule.consumed_before(iteration)
        return consumed, schedule.at(consumed) // (self.run.training.micro_batch_size * self.mesh.dp_size)

    def global_batch_size(self, iteration: int) -> int:
        schedule = self.run.training.batch_schedule
        return schedule.at(schedule.consumed_before(iteration))

    def _executor(self, iteration: int) -> PipelineExecutor:
        """The executor for this iteration's number of microbatches (it changes while the batch grows)."""
        m = self._train_plan(iteration)[1]
        if m not in self._executors:
            self._executors[m] = PipelineExecutor(self.chunks, self.mesh, replace(self._spec, num_microbatches=m))
        return self._executors[m]

    def learning_rates(self) -> tuple[float, float | None]:
        """(lr, embedding/output-layer lr or None) for the next update. Megatron's scheduler advances
        by the global batch size after each successful update only, so its step is the samples of the
        optimizer's successful steps (with a growing batch: of the first that many iterations, which
        differs from Megatron only if an fp16 iteration was skipped during the ramp-up)."""
        run = self.run
        if run.lr_schedule is None:
            return run.optimizer.lr, None
        samples = run.training.batch_schedule.update_samples(self.optimizer.adam.step_count)
        decoupled = run.decoupled_lr_schedule
        return run.lr_schedule(samples), decoupled(samples) if decoupled is not None else None

    def batch_fn(self, iteration: int):
        return self.loaders["train"].batch_fn(iteration)

    def close(self) -> None:
        """Stop the data loaders and release the model's hooks, so that the model's memory is freed
        once the trainer is dropped (a process that builds several trainers, as the tests do)."""
        for loader in self.loaders.values():
            loader.close()
        for chunk in self.chunks:
            chunk.release_hooks()

    def parameters_on_rank(self) -> int:
        return sum(p.numel() for chunk in self.chunks for p in chunk.module.parameters())

    def forward_backward(self, iteration: int):
        """Run all microbatches of `iteration` and leave the reduced gradients of the global
        mean token loss in `main_grad`. Returns (mean lm loss, learning rate, loss scale,
        pipeline idle fraction), read by the host (train_step reads none of them)."""
        loss, lr, loss_scale, stats, _ = self._forward_backward(iteration)
        return loss.item(), lr, loss_scale, stats.idle_fraction

    def _forward_backward(self, iteration: int) -> tuple[torch.Tensor, float, float, StepStats, dict]:
        lr, decoupled_lr = self.learning_rates()
        self.optimizer.set_lr(lr, decoupled_lr)
        for chunk in self.chunks:
            chunk.train()
        loss_scale = self.optimizer.loss_scale
        executor = self._executor(iteration)
        modules = [chunk.module for chunk in self.chunks]
        # the main loss's backward scale, times cp as megatron-core's forward_step sets it: each cp rank's aux loss
        # is its share of the sequence's, and gradients are averaged over cp
        set_aux_loss_scale(modules, loss_scale / executor.spec.num_microbatches * self.mesh.cp_size)
        stats = executor.run(self.batch_fn(iteration), loss_scale=loss_scale, zero_grads=True)
        loss, grad_scale = reduced_token_mean(stats.token_sums())
        update_expert_biases(modules, self.mesh.stage_group, self.run.model.moe_router_bias_update_rate)
        finalize_model_grads(self.chunks, self.mesh, grad_scale=grad_scale)
        update_delayed_scaling(modules, self.mesh)  # FP8 delayed scaling: this iteration's amaxes -> next scales
        return loss, lr, loss_scale, stats, self.moe_losses(executor.spec.num_microbatches)

    def moe_losses(self, num_microbatches: int) -> dict:
        """This iteration's logged MoE losses, Megatron's way (a collective; empty for a dense model)."""
        config = self.run.model
        if config.num_moe_experts is None:
            return {}
        layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
        return reduced_aux_losses([c.module for c in self.chunks], self.mesh, num_microbatches, layers)

    def train_step(self, iteration: int) -> IterationResult:
        """One iteration. Like Megatron's log, the result carries the learning rate and loss scale
        as they stand after the update (the values the next iteration uses). The host reads one
        number: the global gradient norm, which the update needs (clipping, skipping a
        non-finite step), as Megatron reads it."""
        loss, _, _, stats, moe_losses = self._forward_backward(iteration)
        result = self.optimizer.step()
        return IterationResult(
            mean_loss=loss,
            grad_norm=result.grad_norm,
            skipped=result.skipped,
            lr=self.learning_rates()[0],
            loss_scale=self.optimizer.loss_scale,
            stats=stats,
            data_wait=self.loaders["train"].take_wait_seconds(),
            moe_losses=moe_losses,
        )


class _EventSpan:
    """Device seconds between two CUDA events; calling it waits for the second."""

    def __init__(self, start, end):
        self.start, self.end = start, end

    def __call__(self) -> float:
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1000.0


def timed_step(trainer: Trainer, iteration: int) -> tuple[IterationResult, float | _EventSpan]:
    """One iteration and its duration, without making the host wait: wall clock on CPU; on CUDA
    events around it on the current stream, read (called) only when a log line needs them."""
    if trainer.device.type != "cuda":
        start = time.perf_counter()
        result = trainer.train_step(iteration)
        return result, time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    result = trainer.train_step(iteration)
    end.record()
    return result, _EventSpan(start, end)
