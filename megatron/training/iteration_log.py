"""What the training loop reports after each iteration, with Megatron's timing.

- a line every --log-interval iterations and after the last iteration, and always after the
  first iteration of a run. A line closes the averaging window unless it is only there for
  being the first (the next line then covers that iteration too). A checkpoint stores the
  window still open (`window_state`), so a run resumed from it prints the very lines (loss,
  grad norm, learning rate, skipped counts) the uninterrupted run prints, at Megatron's
  intervals (Megatron itself starts a resumed run with an empty window);
- Megatron's memory line once, after the first iteration;
- TensorBoard / W&B scalars with every line (iteration time, memory and world size when asked);
- --log-params-norm and --log-num-zeros-in-grad figures (collectives: every rank calls `report`).
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from megatron.core.optimizer.grad_preparation import global_grad_norm
from megatron.core.transformer.flops import flops_per_iteration
from megatron.training.log import (
    IntervalTotals,
    TensorBoardWriter,
    WandbWriter,
    format_iteration_line,
    memory_figures,
    memory_line,
)
from megatron.training.offload_run import offload_line


def params_norm(optimizer) -> float:
    """Global L2 norm of the fp32 master weights, each element counted once (as the grad norm).
    Offloaded masters are read where they are once their CPU step is done."""
    optimizer.wait_for_step()
    return global_grad_norm(optimizer.counted(lambda s: s.main), optimizer.device)


def num_zeros_in_grad(optimizer) -> int:
    """Gradient elements equal to zero over the whole model, each counted once."""
    device = optimizer.shards[0].grad.device if optimizer.shards else None
    zeros = torch.zeros(1, dtype=torch.float64, device=device)
    for replicas, views in optimizer.counted(lambda s: s.grad).items():
        for view in views:
            zeros += (view == 0).sum().double() / replicas
    dist.all_reduce(zeros)
    return round(zeros.item())


class IterationLog:
    def __init__(self, trainer, emit, first_iteration: int, window: dict | None = None):
        """`window`: the open averaging window a checkpoint stored (None: an empty one)."""
        run = trainer.run
        self.trainer, self.emit, self.first_iteration = trainer, emit, first_iteration
        self.config, self.training = run.logging, run.training
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        last = self.rank == self.world - 1
        self.tensorboard = TensorBoardWriter(self.config.tensorboard_dir, enabled=last)
        wandb_dir = self.config.wandb_save_dir or os.path.join(self.config.tensorboard_dir or ".", "wandb")
        self.wandb = WandbWriter(
            self.config.wandb_project,
            self.config.wandb_exp_name,
            wandb_dir,
            {"model": vars(run.model).copy(), "training": vars(run.training).copy()},
            last,
        )
        self.totals = IntervalTotals() if window is None else IntervalTotals.from_state(window["totals"])
        self.data_wait = 0.0 if window is None else window["data_wait"]
        self._auto_logged = False

    def window_state(self) -> dict:
        """The open averaging window of the rank that prints (a collective: every rank gets it)."""
        state = [{"totals": self.totals.state(), "data_wait": self.data_wait} if self.rank == self.world - 1 else None]
        dist.broadcast_object_list(state, src=self.world - 1)
        return state[0]

    def report(self, iteration: int, result, elapsed, force: bool = False) -> None:
        """Account for one iteration; print and write scalars when a line is due. `elapsed`: its
        seconds, or a callable giving them (read only for a line, see training.timed_step);
        `force`: the window ends here (the last iteration, an early exit)."""
        self.totals.add(
            result.mean_loss, elapsed, result.skipped, lambda stats=result.stats: stats.idle_fraction, result.moe_losses
        )
        self.data_wait += result.data_wait
        first = iteration == self.first_iteration
        closes = force or iteration % self.config.log_interval == 0
        if not (first or closes):
            return
        trainer, totals, config = self.trainer, self.totals, self.config
        optimizer = trainer.optimizer
        norm = params_norm(optimizer) if config.log_params_norm else None
        zeros = num_zeros_in_grad(optimizer) if config.log_num_zeros_in_grad else None
        schedule = self.training.batch_schedule
        batch = trainer.global_batch_size(iteration)
        seconds = totals.elapsed / totals.iterations
        tflops = flops_per_iteration(trainer.run.model, batch) / seconds / self.world / 1e12
        self.emit(
            format_iteration_line(
                iteration=iteration,
                train_iters=self.training.train_iters,
                consumed_samples=schedule.consumed_before(iteration + 1),
                elapsed_ms=seconds * 1000.0,
                tflops_per_gpu=tflops,
                lr=result.lr,
                global_batch_size=batch,
                lm_loss=totals.loss,
                loss_scale=result.loss_scale,
                grad_norm=result.grad_norm,
                skipped=totals.skipped,
                nan=totals.nan,
                num_zeros=zeros,
                params_norm=norm,
                extra_losses=totals.extra,
            )
        )
        if trainer.mesh.pp_size > 1:
            idle = [None] * self.world
            dist.all_gather_object(idle, round(totals.idle_sum / totals.iterations, 3))
            self.emit(f"  pipeline idle fraction per rank (measured time waiting on p2p / step time): {idle}")
        if optimizer.adam.offload is not None:
            self._offload_lines()
        wait = self.data_wait / totals.iterations
        self.emit(
            f"  data loader wait (last rank): {wait * 1000.0:.1f} ms per iteration, {wait / seconds:.1%} of the step"
        )
        memory = memory_figures(trainer.device)
        if first:
            self.emit(memory_line(self.rank, iteration, memory))
        self._scalars(iteration, result, totals.loss, batch, seconds, memory, norm, zeros)
        if closes:
            self.totals, self.data_wait = IntervalTotals(), 0.0

    def _offload_lines(self) -> None:
        decision = self.trainer.placement_decision
        if decision is not None and not self._auto_logged:
            self._auto_logged = True
            self.emit(decision.describe() + " (last rank)")
        self.emit(offload_line(self.trainer.optimizer) + " (last rank)")

    def _scalars(self, iteration, result, loss, batch, seconds, memory, norm, zeros) -> None:
        config = self.config
        values = {
            "lm loss": loss,
            **self.totals.extra,
            "learning-rate": result.lr,
            "batch-size": batch,
            "grad-norm": result.grad_norm,
            "loss-scale": result.loss_scale,
            "params-norm": norm,
            "num-zeros": zeros,
        }
        if config.log_timers_to_tensorboard:
            values["iteration-time"] = seconds
        if config.log_memory_to_tensorboard:
            values.update({f"mem-{name.replace(' ', '-')}-MB": value for name, value in memory.items()})
        if config.log_world_size_to_tensorboard:
            values["world-size"] = self.world
        self.tensorboard.scalars(iteration, values)
        self.wandb.scalars(iteration, values)

    def validation(self, iteration: int, loss: float) -> None:
        """Validation loss (and perplexity with --log-validation-ppl-to-tensorboard) as scalars."""
        values = {"lm loss validation": loss}
        if self.config.log_validation_ppl_to_tensorboard:
            values["lm loss validation ppl"] = math.exp(min(20.0, loss))
        self.tensorboard.scalars(iteration, values)
        self.wandb.scalars(iteration, values)

    def close(self) -> None:
        self.wandb.finish()
