"""AdamW over fp32 master weights in flat shards, with global-norm clipping and loss scaling.

The optimizer in three parts (see docs/architecture.md):
1. gradient preparation (`grad_preparation`): unscale and inf check, global norm, clipping;
2. state and step (`adamw.ShardedAdamW`): AdamW on one flat fp32 shard per bucket;
3. parameter sync (`param_sync.ParamSync`): copy back in the model dtype, all-gather.
Replicated and distributed (ZeRO-1/2) optimizers are this one class: the model chunks'
buffers decide whether a shard is a whole bucket or this rank's 1/(dp x cp) of it.
Gradients arrive reduced in the buffers' fp32 `main_grad` (see megatron.core.distributed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron.core.distributed.placement import forward_order
from megatron.core.optimizer.adamw import ShardedAdamW
from megatron.core.optimizer.config import OptimizerConfig
from megatron.core.optimizer.grad_preparation import clip_grads, global_grad_norm, unscale_and_check
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.offload import OffloadedSteps
from megatron.core.optimizer.param_sync import ParamSync
from megatron.core.optimizer.shards import build_shards


@dataclass
class StepResult:
    skipped: bool
    grad_norm: float | None
    loss_scale: float


def build_grad_scaler(config: OptimizerConfig):
    if not config.fp16:
        return None
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    return DynamicGradScaler(
        config.initial_loss_scale, config.min_loss_scale, config.loss_scale_window, config.hysteresis
    )


class MixedPrecisionOptimizer:
    """`chunks`: this rank's ModelChunkBuffers (their buffers give the shards). `host`: the
    host-resident chunks (distributed.host_chunks.HostChunks) with the offload optimizer: its
    placement says whose optimizer state lives in its host slab (and is stepped by the CPU)."""

    def __init__(self, chunks: list, config: OptimizerConfig, mesh, host=None):
        if config.offload.enabled != (host is not None):
            raise ValueError(
                "the offload optimizer and host-resident chunks come together: pass `host` exactly "
                "when config.offload is enabled"
            )
        self.config = config
        buffers = [buffer for chunk in chunks for buffer in chunk.buffers]
        device = self.device = buffers[0].device if buffers else torch.device("cpu")
        self.host = host
        memory, offloaded = (host.memory, host.placement.optimizer) if host is not None else (None, frozenset())
        self.shards = build_shards(buffers, mesh, memory, offloaded)
        self.adam = ShardedAdamW(
            self.shards,
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            host_memory=memory,
        )
        if host is not None:
            buffer_of = [b for b in buffers for _ in b.buckets]  # shard index -> its gradient's buffer
            self.adam.offload = OffloadedSteps(
                self.adam, forward_order(buffers), device, config.offload.cpu_threads, buffer_of
            )
        self.chunks = chunks
        self.param_sync = ParamSync(self.shards, chunks, self.adam.offload)
        self.grad_scaler = build_grad_scaler(config)

    def counted(self, tensor_of) -> dict[int, list]:
        """The pieces of `tensor_of(shard)` (its gradient, its master weights) that count in a global norm,
        keyed by how many ranks hold the same pieces (see grad_preparation.global_grad_norm)."""
        out: dict[int, list] = {}
        for shard in self.shards:
            out.setdefault(shard.replicas, []).extend(shard.views(tensor_of(shard), shard.counted))
        return out

    @property
    def loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def set_lr(self, lr: float, decoupled_lr: float | None = None) -> None:
        """`decoupled_lr`: the embedding's and output layer's learning rate (Megatron's
        --decoupled-lr); None: they use `lr` too."""
        self.adam.lr, self.adam.decoupled_lr = lr, decoupled_lr

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (master copies and moments), from the tensors."""
        return sum(t.numel() * t.element_size() for t in self.adam.state_tensors())

    def state_dict_by_name(self) -> dict:
        """This rank's optimizer state per parameter, for checkpoints by name: `name` ->
        [(start, numel, {"master", "exp_avg", "exp_avg_sq": fp32 views})], the pieces of the
        flattened local (tp-shard) parameter held here (a parameter may straddle two ranks'
        shards: one piece on each), plus "step": the number of steps taken."""
        if self.adam.offload is not None:
            self.adam.offload.wait_all()  # host state is final once its CPU steps are done
        out: dict = {"step": self.adam.step_count}
        for shard, exp_avg, exp_avg_sq in zip(self.shards, self.adam.exp_avg, self.adam.exp_avg_sq):
            for piece in shard.pieces:
                views = {
                    key: t[piece.shard_start : piece.shard_end]
                    for key, t in (("master", shard.main), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq))
                }
                out.setdefault(piece.name, []).append((piece.param_start, piece.numel, views))
        return out

    def scalar_state(self) -> dict:
        """The state that is not per parameter, equal on every rank: the step count (bias
        correction, learning-rate schedule) and the loss scaler's state (None without fp16)."""
        return {
            "step": self.adam.step_count,
            "loss_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
        }

    def load_scalar_state(self, state: dict) -> None:
        """Restore `scalar_state()`; a loss scaler saved by another precision is ignored."""
        self.adam.step_count = state["step"]
        if self.grad_scaler is not None and state["loss_scaler"] is not None:
            self.grad_scaler.load_state_dict(state["loss_scaler"])

    @torch.no_grad()
    def reload_master_weights(self) -> None:
        """Restart the fp32 master weights of low-precision parameters from the model weights
        (Megatron's `reload_model_params`: after loading a model without its optimizer state);
        fp32 parameters are their own master weights."""
        for shard in self.shards:
            if not shard.aliased:
                shard.main.copy_(shard.model)

    def step(self) -> StepResult:
        """Skipped (no state changed on any rank) when any rank's shard saw inf/nan."""
        self.param_sync.finish()  # the previous step has landed everywhere (offloaded chunks included)
        grads = [shard.grad for shard in self.shards]
        scale = self.loss_scale
        if self.grad_scaler is not None:
            found_inf = unscale_and_check(grads, scale, self.device)
            self.grad_scaler.update(found_inf)
            if found_inf:
                return StepResult(skipped=True, grad_norm=None, loss_scale=scale)
        grad_norm = global_grad_norm(self.counted(lambda s: s.grad), self.device)
        if not math.isfinite(grad_norm):
            return StepResult(skipped=True, grad_norm=grad_norm, loss_scale=scale)
        if self.config.clip_grad > 0:
            clip_grads(grads, grad_norm, self.config.clip_grad)
        self.adam.step()
        self.param_sync.start()
        return StepResult(skipped=False, grad_norm=grad_norm, loss_scale=scale)

    def wait_for_step(self) -> None:
        """Wait until the last step's state is final everywhere (offloaded CPU steps included)."""
        self.param_sync.finish()

    def finish_param_sync(self) -> None:
        """Make the parameters whole before reading them outside a forward pass: wait for gathers
        still in flight (`--overlap-param-gather`) and gather sharded ones (optim_grads_params)."""
        self.param_sync.finish()
        for chunk in self.chunks:
            chunk.gather_all_params()
