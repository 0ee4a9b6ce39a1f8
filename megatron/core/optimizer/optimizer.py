"""AdamW over fp32 master weights, with global-norm clipping and optional loss scaling.

Model parameters may be fp32, bf16 or fp16; their gradients arrive in fp32
`main_grad` buffers (see megatron.core.distributed). fp32 parameters are their
own master weights; low-precision ones get an fp32 copy that AdamW updates and
that is copied back after each step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core.optimizer.clip_grads import clip_grads, global_grad_norm
from megatron.core.optimizer.config import OptimizerConfig
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler


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
    return DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale, config.loss_scale_window,
                             config.hysteresis)


class MixedPrecisionOptimizer:
    def __init__(self, model_params: list, config: OptimizerConfig, mesh):
        self.config = config
        self.mesh = mesh
        self.model_params = [p for p in model_params if p.requires_grad]
        self.main_params = [p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float())
                            for p in self.model_params]
        for main, model in zip(self.main_params, self.model_params):
            main.counts_in_norm = counts_in_grad_norm(model, mesh)
        decay = [p for p in self.main_params if p.ndim >= 2]
        no_decay = [p for p in self.main_params if p.ndim < 2]
        self.inner = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
        self.grad_scaler = build_grad_scaler(config)

    @property
    def loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def set_lr(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr

    def _unscale_and_check(self, scale: float) -> bool:
        """Divide the gradients by the loss scale; True when any rank saw inf/nan.
        One fused pass and one synchronisation, whatever the number of parameters."""
        device = self.main_params[0].device if self.main_params else None
        found_inf = torch.zeros(1, device=device)
        grads = [p.grad for p in self.main_params]
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf,
                                                            torch.full((1,), 1.0 / scale, device=device))
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return bool(found_inf.item())

    @torch.no_grad()
    def step(self) -> StepResult:
        for main, model in zip(self.main_params, self.model_params):
            main.grad = model.main_grad
        scale = self.loss_scale
        if self.grad_scaler is not None:
            found_inf = self._unscale_and_check(scale)
            self.grad_scaler.update(found_inf)
            if found_inf:
                self._drop_grads()
                return StepResult(skipped=True, grad_norm=None, loss_scale=scale)
        grad_norm = global_grad_norm(self.main_params, self.mesh)
        if not math.isfinite(grad_norm):
            self._drop_grads()
            return StepResult(skipped=True, grad_norm=grad_norm, loss_scale=scale)
        if self.config.clip_grad > 0:
            clip_grads(self.main_params, grad_norm, self.config.clip_grad)
        self.inner.step()
        for main, model in zip(self.main_params, self.model_params):
            if main is not model:
                model.copy_(main)
        self._drop_grads()
        return StepResult(skipped=False, grad_norm=grad_norm, loss_scale=scale)

    def _drop_grads(self) -> None:
        for main in self.main_params:
            main.grad = None


def counts_in_grad_norm(param, mesh) -> bool:
    """Whether this rank's copy counts in the global norm: weights replicated across tp
    count on tp rank 0 only; the tied output-layer copy on the last stage not at all."""
    if getattr(param, "shared_embedding", False) and not mesh.is_first_stage:
        return False
    return getattr(param, "tensor_model_parallel", False) or mesh.tp_rank == 0
