"""One model chunk (a pipeline stage's slice of layers) with its flat parameter and gradient buffers.

Gradient hooks add each parameter's gradient to its fp32 `main_grad` view (a linear layer adds
its weight's there itself, or queues it, and autograd never sees it: tensor_parallel/layers.py;
either way the chunk's WeightGradQueue learns the gradient is complete) and, on the last
microbatch of the iteration, start the reduction of each bucket as soon as backward has
completed it, so the dp x cp reduction overlaps the rest of backward (`overlap_grad_reduce`;
without it every bucket is reduced when backward has finished). With the distributed
optimizer and `overlap_param_gather`, the optimizer step only starts the all-gathers of the
updated parameters and forward pre-hooks wait for a module's buckets just before its first
use, so the gathers overlap the next iteration's forward instead of blocking the step.
With sharded gradients (optim_grads, optim_grads_params) every microbatch's buckets are
reduce-scattered as backward completes them, and module hooks (`param_gather.BucketHooks`)
make each bucket's unsharded gradient exist before a module's backward and, for
optim_grads_params, gather and release its parameters around each use.

Usage per iteration: `zero_grad_buffer()`; before each microbatch's backward
`set_is_last_microbatch(...)`; after the last backward `finish_grad_sync()` (called by
`finalize_model_grads`). A split backward of microbatch i runs inside
`deferring_weight_grads(i)` and is completed by `compute_weight_grads(i)`, after it but not
necessarily before later microbatches' backwards (zero-bubble schedules), in microbatch order,
with `set_is_last_microbatch(...)` set for that step too.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core.distributed.bucket_layout import STRATEGIES, default_bucket_size
from megatron.core.distributed.param_and_grad_buffer import ParamAndGradBuffer, buffer_layout
from megatron.core.distributed.param_gather import BucketHooks
from megatron.core.tensor_parallel.initialization import is_deferred
from megatron.core.tensor_parallel.weight_grads import WeightGradQueue


@dataclass
class DDPConfig:
    """`bucket_size` in elements (None: `default_bucket_size` of the dp x cp size).
    `sharding_strategy`: one of STRATEGIES; `use_distributed_optimizer` alone means "optim".
    `reshard_after_forward` (optim_grads_params): release a bucket's parameters after the
    forward's last use and gather them again for backward; False keeps them gathered from a
    microbatch's forward to its backward (the trainer's choice under pipeline parallelism).
    `unsharded_grad_accumulation` (optim_grads, optim_grads_params): a bucket's whole gradient
    stays from the iteration's first backward to its last and is reduce-scattered once."""

    bucket_size: int | None = None
    grad_dtype: torch.dtype = torch.float32
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    sharding_strategy: str = "no_shard"
    reshard_after_forward: bool = True
    unsharded_grad_accumulation: bool = False

    def __post_init__(self):
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"--ddp-bucket-size must be >= 1, got {self.bucket_size}")
        if self.sharding_strategy not in STRATEGIES:
            raise ValueError(
                f"--data-parallel-sharding-strategy must be one of {', '.join(STRATEGIES)}, "
                f"got {self.sharding_strategy!r}"
            )
        if self.use_distributed_optimizer and self.sharding_strategy == "no_shard":
            self.sharding_strategy = "optim"
        self.use_distributed_optimizer = self.sharding_strategy != "no_shard"
        if self.sharding_strategy == "optim_grads_params" and self.overlap_param_gather:
            raise ValueError(
                "--overlap-param-gather applies to the optim and optim_grads strategies: "
                "optim_grads_params gathers each bucket before its first use anyway"
            )
        if self.sharding_strategy in ("optim_grads", "optim_grads_params") and not self.overlap_grad_reduce:
            raise ValueError(
                f"--data-parallel-sharding-strategy {self.sharding_strategy} reduce-scatters each "
                "bucket as backward completes it: drop --no-overlap-grad-reduce"
            )
        if self.unsharded_grad_accumulation and self.sharding_strategy not in ("optim_grads", "optim_grads_params"):
            raise ValueError(
                "--unsharded-grad-accumulation applies to the optim_grads and optim_grads_params strategies"
            )
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError(
                "--overlap-param-gather needs --use-distributed-optimizer (replicated parameters are never gathered)"
            )

    @property
    def shards_grads(self) -> bool:
        return self.sharding_strategy in ("optim_grads", "optim_grads_params")

    @property
    def shards_params(self) -> bool:
        return self.sharding_strategy == "optim_grads_params"


def _trained_params(module: torch.nn.Module) -> list:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _buffer_args(module: torch.nn.Module, config: DDPConfig, dp_cp_group, expert_dp_group) -> list[dict]:
    """What each of the chunk's buffers is made of: the dense parameters, and the expert weights
    (`is_expert`) reduced over `expert_dp_group` and divided by dp x cp, as Megatron reduces them."""

    def bucket_size(group) -> int:
        return config.bucket_size or default_bucket_size(dist.get_world_size(group))

    named = _trained_params(module)
    dense = [(n, p) for n, p in named if not getattr(p, "is_expert", False)]
    experts = [(n, p) for n, p in named if getattr(p, "is_expert", False)]
    out = [dict(named_params=list(reversed(dense)), bucket_size=bucket_size(dp_cp_group), group=dp_cp_group)]
    if experts:
        out.append(
            dict(
                named_params=list(reversed(experts)),
                bucket_size=bucket_size(expert_dp_group),
                group=expert_dp_group,
                grad_divisor=dist.get_world_size(dp_cp_group),
            )
        )
    return out


def chunk_layouts(module: torch.nn.Module, config: DDPConfig, dp_cp_group, expert_dp_group=None) -> list:
    """The BufferLayouts of the buffers ModelChunkBuffers would make for `module`, without making
    them: host-resident chunks are placed before any of their memory exists."""
    return [
        buffer_layout(a["named_params"], a["bucket_size"], a["group"], config.sharding_strategy)
        for a in _buffer_args(module, config, dp_cp_group, expert_dp_group)
    ]


class ModelChunkBuffers(torch.nn.Module):
    def __init__(
        self,
        module: torch.nn.Module,
        config: DDPConfig,
        dp_cp_group,
        init_seed: int | None = None,
        expert_dp_group=None,
        host=None,
        reducing: list | None = None,
    ):
        """`init_seed`: the run's seed, for parameters made under `deferred_initialization`
        (initialised in the buffer, see ParamAndGradBuffer). Expert weights (`is_expert`) get a buffer
        of their own, `expert_buffer` (see `_buffer_args`); `buffers` lists both. `host`: the rank's
        HostChunks, which gives host-resident buckets their shards as they are made. `reducing`: the
        rank's list of buckets being reduced, shared by all its chunks (None: one for this chunk)."""
        super().__init__()
        self.module = module
        self.config = config
        self.sync_now = True
        self.weight_grads = WeightGradQueue(self._gradient_final)
        named = _trained_params(module)
        shared = [] if reducing is None else reducing  # by this chunk's buffers at least
        common = dict(grad_dtype=config.grad_dtype, strategy=config.sharding_strategy, init_seed=init_seed)
        common.update(host=host, reducing=shared)
        dense, *experts = _buffer_args(module, config, dp_cp_group, expert_dp_group)
        self.buffer = ParamAndGradBuffer(**dense, **common)
        self.expert_buffer = ParamAndGradBuffer(**experts[0], **common) if experts else None
        self.buffers = [b for b in (self.buffer, self.expert_buffer) if b is not None]
        self._buffer_of = {p: b for b in self.buffers for p in b.params.values()}
        unplaced = [n for n, p in module.named_parameters() if is_deferred(p)]
        if unplaced:
            raise ValueError(
                f"{unplaced[0]}: a deferred parameter outside the gradient buffers was never "
                "initialised (frozen parameters are not built deferred)"
            )
        self.bucket_hooks = (
            BucketHooks(module, self.buffer, config.reshard_after_forward) if self.buffer.shards_grads else None
        )
        self.expert_bucket_hooks = (
            BucketHooks(module, self.expert_buffer, config.reshard_after_forward)
            if self.expert_buffer is not None and self.expert_buffer.shards_grads
            else None
        )
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate) for _, p in named]
        for _, param in named:
            param.weight_grad_queue = self.weight_grads
        if config.overlap_param_gather:
            self._hooks += [
                m.register_forward_pre_hook(self._wait_for_params(m))
                for m in module.modules()
                if any(True for _ in m.parameters(recurse=False))
            ]

    def release_hooks(self) -> None:
        """Remove this chunk's hooks. Autograd holds a post-accumulate-grad hook out of the garbage
        collector's sight, so without this a closed trainer's parameters and buffers (the hook's
        bound method reaches them) stay allocated for the life of the process."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _accumulate(self, param: torch.Tensor) -> None:
        """A gradient autograd accumulated into `param.grad` (linear layers' own weights never reach
        autograd: their layers add it into main_grad and tell the queue themselves). Autograd also
        calls this hook when the backward gave the parameter no gradient."""
        if param.grad is None:
            return
        self._prepare_grad(param)
        param.main_grad.add_(param.grad)
        param.grad = None
        self.weight_grads.added(param)

    def _gradient_final(self, param: torch.Tensor) -> None:
        if self.buffer.shards_grads:  # every microbatch; parameters are no longer needed once all are final
            reduce = self.sync_now or not self.config.unsharded_grad_accumulation
            bucket = self._buffer_of[param].mark_ready(param, reduce)
            if bucket is not None and (self.config.reshard_after_forward or self.sync_now):
                bucket.release_params()
        elif self.sync_now and self.config.overlap_grad_reduce:
            self._buffer_of[param].mark_ready(param)

    def deferring_weight_grads(self, microbatch: int = 0):
        """A backward of `microbatch` inside leaves the linear layers' weight gradients for
        `compute_weight_grads(microbatch)`, and every gradient it completes counts as final only then."""
        return self.weight_grads.deferring(microbatch)

    def compute_weight_grads(self, microbatch: int = 0) -> None:
        """The WEIGHT step of `microbatch`: its queued weight gradients, then its gradients final
        (WEIGHT steps of one chunk run in microbatch order, so each bucket's reductions see whole
        microbatches; `set_is_last_microbatch` applies to this step)."""
        for param in self.weight_grads.compute(microbatch, self._prepare_grad):
            self._gradient_final(param)

    def _prepare_grad(self, param) -> None:
        buffer = self._buffer_of[param]
        buffer.prepare_grad(buffer.bucket_of[param])

    def _wait_for_params(self, module: torch.nn.Module):
        buckets = {self._buffer_of[p].bucket_of[p] for p in module.parameters(recurse=False) if p in self._buffer_of}

        def hook(*_):
            for bucket in buckets:
                bucket.finish_param_gather()

        return hook

    def forward(self, *args, **kwargs):
        hooks = [h for h in (self.bucket_hooks, self.expert_bucket_hooks) if h is not None]
        if not hooks:  # gradients not sharded: nothing to gather around the pass
            return self.module(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for hook in hooks:
                stack.enter_context(hook.forward_pass())
            return self.module(*args, **kwargs)

    def set_is_last_microbatch(self, last: bool) -> None:
        """Gradients of earlier microbatches only accumulate; the last one's complete each bucket."""
        self.sync_now = last

    def zero_grad_buffer(self) -> None:
        for buffer in self.buffers:
            buffer.zero()

    def finish_grad_sync(self) -> None:
        for buffer in self.buffers:
            buffer.finish_grad_reduce()
        self.sync_now = True
        for bucket in self._buckets():  # sharded parameters: none stays gathered into the step
            bucket.release_params()

    def start_param_gather(self) -> None:
        """After the optimizer step. Sharded parameters are gathered when next used (gathered copies
        are stale now); others are all-gathered here (and waited for unless overlapped)."""
        if self.buffer.shards_params:
            for bucket in self._buckets():
                bucket.release_params()
            return
        for buffer in self.buffers:
            buffer.start_param_gather()
            if not self.config.overlap_param_gather:
                buffer.finish_param_gather()

    def finish_param_gather(self) -> None:
        for buffer in self.buffers:
            buffer.finish_param_gather()

    def gather_all_params(self) -> None:
        """Sharded parameters: make every bucket whole, to read the parameters outside a forward
        (a checkpoint, a test); the next forward releases them again."""
        if self.buffer.shards_params:
            for bucket in self._buckets():
                bucket.gather_params()

    def params_written(self) -> None:
        """The whole parameters were written outside training (a checkpoint was loaded): take this
        rank's shard of them."""
        for buffer in self.buffers:
            buffer.take_param_shards()

    def _buckets(self):
        return [bucket for buffer in self.buffers for bucket in buffer.buckets]
