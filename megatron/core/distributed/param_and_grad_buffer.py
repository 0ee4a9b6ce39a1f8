"""Parameter and gradient buffers of one model chunk, and the collectives of their buckets.

Every parameter's storage becomes a view into a parameter buffer (model dtype) and its
`main_grad` a view into a gradient buffer (fp32 by default, whatever the weights), laid out by
`BufferLayout`. Microbatch gradients accumulate there in fp32 and each bucket (memory chunk) is
reduced over the dp x cp group with one collective. What a rank keeps depends on the sharding
strategy (Megatron-FSDP's names):
- no_shard (replicated optimizer): whole buffers; each bucket is all-reduced once per iteration;
- optim (distributed optimizer): whole buffers; each bucket is reduce-scattered once per
  iteration, after which each rank holds only its shard of the averaged bucket (the rest is
  stale and never read); after the optimizer step each bucket's parameters are all-gathered;
- optim_grads: no whole gradient buffer. A bucket's unsharded gradient exists only while a
  microbatch's backward fills it (`TransientBuffer`); once complete it is reduce-scattered and
  added into the rank's persistent fp32 shard, then freed. That is one reduce-scatter per
  bucket per microbatch instead of one per iteration;
- optim_grads_params: as optim_grads, and the parameters too are kept as this rank's shard
  only; a bucket's whole parameters exist while gathered (`gather_params` / `release_params`,
  driven by the module hooks of `param_gather.py`).
Under the last two, a bucket's gradient shard and parameter shard may live in host memory
(cut from `host_chunks.HostChunks`'s slab when the bucket is made, never on the device): the
reduce-scattered gradient is then added on host, and the parameter shard is copied into the
gathered bucket before the all-gather.
"Local shard" below means this rank's shard (the whole bucket when replicated): the part of
the gradient that is valid after the reduction and that this rank's optimizer steps.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron.core.distributed import collectives
from megatron.core.distributed.bucket_layout import SHARD_ALIGN, STRATEGIES, BufferLayout
from megatron.core.distributed.transient import TransientBuffer
from megatron.core.tensor_parallel.initialization import initialize_, is_deferred


class Bucket:
    """Views of one bucket in both buffers, the parameters whose gradients fill it, and the
    handles of its collectives in flight. `param_data`/`grad_data`: the chunk's flat buffers, or
    None where this bucket has its own transient one (sharded gradients / parameters). `host`:
    the rank's HostChunks, which gives the bucket its host-resident shards (None: all on the device)."""

    def __init__(
        self,
        place,
        param_data,
        grad_data,
        params: list,
        group,
        shard_rank: int,
        *,
        dtype: torch.dtype,
        grad_dtype: torch.dtype,
        device,
        grad_divisor: int | None = None,
        host=None,
    ):
        self.place = place
        start, end = place.shard(shard_rank)
        self.shard_slot = slice(start - place.start, end - place.start)  # this rank's part of the whole bucket
        self.shards_grads, self.shards_params = grad_data is None, param_data is None
        self.host_chunks = host
        host_param, host_grad = (
            (None, None)
            if host is None
            else host.next_shards(end - start, dtype, grad_dtype, self.shards_params, self.shards_grads)
        )
        self.params_on_host, self.grads_on_host = host_param is not None, host_grad is not None
        if self.shards_params:  # gathered on demand; whole at construction only while its parameters are placed
            self.param_full = TransientBuffer(place.numel, dtype, device)
            self.param = self.param_full.data
            self.param_shard = (
                host_param if self.params_on_host else torch.zeros(end - start, dtype=dtype, device=device)
            )
        else:
            self.param = param_data[place.start : place.end]
            self.param_shard = param_data[start:end]
        if self.shards_grads:
            self.grad_full = TransientBuffer(place.numel, grad_dtype, device)  # freed once views are taken
            self.grad = self.grad_full.data
            self.grad_shard = (
                host_grad if self.grads_on_host else torch.zeros(end - start, dtype=grad_dtype, device=device)
            )
            self._scattered = None  # the reduce-scatter's output, added into grad_shard when it lands
        else:
            self.grad = grad_data[place.start : place.end]
            self.grad_shard = grad_data[start:end]
        self.params = set(params)
        self.group, self.group_size = group, dist.get_world_size(group)
        self.grad_divisor = self.group_size if grad_divisor is None else grad_divisor
        self.sharded = place.shards > 1
        self.ready: set = set()
        self.reducing = False
        self.grad_handle = self.param_handle = None
        self.before_gather = None  # called once before the next gather (an offloaded shard's CPU step landing)

    # ---- gradients ----

    def prepare_grad(self) -> None:
        """Sharded gradients: make the unsharded bucket exist (zeroed) before a gradient is added."""
        if self.shards_grads and not self.grad_full.allocated:
            self.grad_full.allocate()
            self.grad.zero_()

    def start_grad_reduce(self) -> None:
        """Average the bucket over the group, asynchronously (once per iteration; per microbatch
        with sharded gradients, where a bucket no gradient reached has nothing to reduce)."""
        if self.reducing or (self.shards_grads and not self.grad_full.allocated):
            return
        self.reducing = True
        if self.grad_divisor > 1:
            self.grad.div_(self.grad_divisor)  # gloo has no AVG: sum of the pre-divided gradients
        if self.shards_grads:  # on the device whatever the shard's place: the collective writes it
            self._scattered = torch.empty(self.grad_shard.shape, dtype=self.grad.dtype, device=self.grad.device)
            if self.group_size == 1:
                self._scattered.copy_(self.grad)
            else:
                self.grad_handle = collectives.reduce_scatter_single(
                    self._scattered, self.grad, group=self.group, async_op=True
                )
        elif self.group_size > 1 and self.sharded:
            self.grad_handle = collectives.reduce_scatter_single(
                self.grad_shard, self.grad, group=self.group, async_op=True
            )
        elif self.group_size > 1:
            self.grad_handle = dist.all_reduce(self.grad, group=self.group, async_op=True)

    def finish_grad_reduce(self) -> None:
        """Wait for the reduction; with sharded gradients add it into the shard and free the bucket."""
        if self.grad_handle is not None:
            self.grad_handle.wait()
        if self.shards_grads and self.reducing:
            if self.grads_on_host:
                self.host_chunks.add_into(self.grad_shard, self._scattered)
            else:
                self.grad_shard.add_(self._scattered)
            self._scattered = None
            self.grad_full.free()
        self.ready.clear()
        self.reducing, self.grad_handle = False, None

    def zero_grad(self) -> None:
        if self.shards_grads:
            self.grad_shard.zero_()
            self.grad_full.free()

    # ---- parameters ----

    def start_param_gather(self) -> None:
        """Gather every rank's shard into the whole bucket of the parameters (allocating it first
        when the parameters are sharded); nothing to do where they are whole already."""
        if not self.sharded and not self.shards_params:
            return
        self.wait_for_shard()
        if self.param_handle is None and (not self.shards_params or self.param_full.allocate()):
            source = self.param_shard
            if self.params_on_host:  # into this rank's own slot of the bucket, gathered in place
                source = self.param[self.shard_slot]
                self.host_chunks.fetch(source, self.param_shard)
            self.param_handle = collectives.all_gather_single(self.param, source, group=self.group, async_op=True)

    def wait_for_shard(self) -> None:
        """Run `before_gather` if one is pending: this rank's shard is final after it."""
        if self.before_gather is not None:
            before, self.before_gather = self.before_gather, None
            before()

    def finish_param_gather(self) -> None:
        if self.param_handle is not None:
            begin = time.perf_counter() if self.params_on_host else None
            self.param_handle.wait()
            self.param_handle = None
            if begin is not None:
                self.host_chunks.record_wait(time.perf_counter() - begin)

    def gather_params(self) -> None:
        if self.params_on_host and (self.param_handle is not None or not self.param_full.allocated):
            self.host_chunks.record_use(started_ahead=self.param_handle is not None)
        self.start_param_gather()
        self.finish_param_gather()

    def take_shard(self) -> None:
        """Copy this rank's shard out of the whole (gathered) bucket of parameters."""
        self.param_shard.copy_(self.param[self.shard_slot])

    def release_params(self) -> None:
        """Sharded parameters: drop the whole bucket (this rank's shard stays)."""
        if self.shards_params:
            self.finish_param_gather()
            self.param_full.free()


def buffer_layout(named_params: list, bucket_size: int, group, strategy: str) -> BufferLayout:
    """The layout of a ParamAndGradBuffer of `named_params` over `group`, without making it."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown sharding strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    shards = dist.get_world_size(group) if strategy != "no_shard" else 1
    params = [(n, p.numel(), getattr(p, "shared_embedding", False)) for n, p in named_params]
    return BufferLayout(params, bucket_size, shards, SHARD_ALIGN)


class ParamAndGradBuffer:
    """`named_params`: (name, parameter) in the order backward produces their gradients.
    `strategy`: one of STRATEGIES (anything but no_shard splits each bucket over the group).
    Parameters made under `deferred_initialization` are initialised here, in their place in the
    buffer (`init_seed`: the run's seed), bucket by bucket: with sharded parameters a bucket is
    whole only while it is filled and its shard taken, and host-resident shards are made in host
    memory (`host`: the rank's HostChunks), so building never holds the whole model on the device."""

    def __init__(
        self,
        named_params: list,
        *,
        grad_dtype: torch.dtype,
        bucket_size: int,
        group,
        strategy: str,
        init_seed: int | None = None,
        grad_divisor: int | None = None,
        host=None,
        reducing: list | None = None,
    ):
        """`grad_divisor`: what the sum over `group` is divided by (None: the group's size, an average);
        expert weights are summed over their expert-data-parallel replicas and divided by dp x cp.
        `reducing` (sharded gradients): the buckets whose reduce-scatter is in flight, a list shared
        by the rank's buffers so that one reduction is in flight per rank, not per buffer (None: this
        buffer's own)."""
        self.layout = buffer_layout(named_params, bucket_size, group, strategy)
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) > 1:
            raise ValueError(f"a model chunk's parameters must share one dtype for its flat buffer, got {dtypes}")
        self.strategy = strategy
        self.shard_rank = dist.get_rank(group) if strategy != "no_shard" else 0
        self.device = named_params[0][1].device if named_params else torch.device("cpu")
        dtype = dtypes.pop() if dtypes else torch.float32
        shard_grads, shard_params = strategy in ("optim_grads", "optim_grads_params"), strategy == "optim_grads_params"
        self.param_data = None if shard_params else torch.zeros(self.layout.numel, dtype=dtype, device=self.device)
        self.grad_data = None if shard_grads else torch.zeros(self.layout.numel, dtype=grad_dtype, device=self.device)
        self.params = dict(named_params)
        self.buckets = []
        members_of: dict[int, list] = {}
        for member in self.layout.params:
            members_of.setdefault(member.bucket, []).append(member)
        for index, place in enumerate(self.layout.buckets):
            members = members_of.get(index, [])
            bucket = Bucket(
                place,
                self.param_data,
                self.grad_data,
                [self.params[p.name] for p in members],
                group,
                self.shard_rank,
                dtype=dtype,
                grad_dtype=grad_dtype,
                device=self.device,
                grad_divisor=grad_divisor,
                host=host,
            )
            self.buckets.append(bucket)
            for member in members:
                self._place(self.params[member.name], member, bucket, init_seed)
            if bucket.shards_params:  # keep the shard; the whole bucket is gathered when first used
                bucket.take_shard()
                bucket.param_full.free()
            bucket.zero_grad()
        self.bucket_of = {param: bucket for bucket in self.buckets for param in bucket.params}
        self.reuse_waits: list = []
        self._reducing = [] if reducing is None else reducing

    @staticmethod
    def _place(param, member, bucket: Bucket, init_seed: int | None) -> None:
        """Make `param` a view of its place in the bucket, with its value: initialised there when it
        was deferred, else copied in; its `main_grad` a view of the gradient bucket."""
        start, end = member.start - bucket.place.start, member.end - bucket.place.start
        view = bucket.param[start:end].view(param.shape)
        if is_deferred(param):
            if init_seed is None:
                raise ValueError(f"{member.name}: a deferred parameter needs the run's seed to be initialised")
            initialize_(view, param.init_spec, init_seed, member.name)
            param.deferred_init = False
        else:
            view.copy_(param.detach())
        param.data = view
        param.main_grad = bucket.grad[start:end].view(param.shape)

    @property
    def shards_grads(self) -> bool:
        return self.grad_data is None

    @property
    def shards_params(self) -> bool:
        return self.param_data is None

    def prepare_grad(self, bucket: Bucket) -> None:
        """Sharded gradients: the bucket's unsharded gradient must exist before a gradient is added
        to it (a reduction of the previous microbatch still in flight is finished first)."""
        if bucket.reducing:
            bucket.finish_grad_reduce()
            self._reducing.remove(bucket)
        bucket.prepare_grad()

    def take_param_shards(self) -> None:
        """Sharded parameters: copy this rank's shard out of the whole (gathered) buckets."""
        for bucket in self.buckets:
            if bucket.shards_params:
                bucket.take_shard()

    def zero(self) -> None:
        """Zero the gradients once whatever still reads them is done (`reuse_waits`: callables
        that make the current stream wait, e.g. for the offload optimizer's copies to host)."""
        for wait in self.reuse_waits:
            wait()
        self.reuse_waits = []
        if self.grad_data is not None:
            self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.zero_grad()

    def mark_ready(self, param, reduce: bool = True):
        """Record that `param`'s gradient is final; start its bucket's reduction once all are and
        return the bucket then (else None). With sharded gradients the reductions still in
        flight finish first (their unsharded buckets are freed; those of the other buffers sharing
        `reducing` too: another model chunk's last bucket would otherwise stay unsharded until that
        chunk's next backward), so at most one bucket is reducing while the next one fills.
        `reduce` False (accumulating unsharded): the complete bucket is returned but keeps its
        whole gradient for the next microbatch."""
        bucket = self.bucket_of[param]
        if param in bucket.ready:  # its bucket may be reducing already: a later addition would be lost
            name = next(n for n, p in self.params.items() if p is param)
            raise RuntimeError(
                f"{name}: gradient reported complete twice in one backward (a weight used twice per forward "
                "must reach its linear layers as another module's, owned=False, so autograd sums its uses)"
            )
        bucket.ready.add(param)
        if len(bucket.ready) < len(bucket.params) or bucket.reducing:
            return None
        if not reduce:
            bucket.ready.clear()
            return bucket
        if self.shards_grads:
            while self._reducing:
                self._reducing.pop().finish_grad_reduce()
            self._reducing.append(bucket)
        bucket.start_grad_reduce()
        return bucket

    def finish_grad_reduce(self) -> None:
        """Start buckets not started yet (no overlap, or parameters without gradients), wait for all."""
        for bucket in self.buckets:
            bucket.start_grad_reduce()
        for bucket in self.buckets:
            bucket.finish_grad_reduce()
        self._reducing[:] = [bucket for bucket in self._reducing if bucket.reducing]  # other buffers' in flight
        for host in {bucket.host_chunks for bucket in self.buckets if bucket.grads_on_host}:
            host.settle()  # host-resident gradients are final (read next: tp/pp reductions, norm, step)

    def start_param_gather(self) -> None:
        """All-gather buckets in the order the next forward uses them (the reverse of backward's)."""
        for bucket in reversed(self.buckets):
            bucket.start_param_gather()

    def finish_param_gather(self) -> None:
        for bucket in self.buckets:
            bucket.finish_param_gather()

    def kept_bytes(self) -> tuple[int, int]:
        """(parameter bytes, gradient bytes) kept on the device between steps: whole buffers, or
        the shards that are not host-resident."""

        def size(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)

        params = size(
            [self.param_data]
            if self.param_data is not None
            else [b.param_shard for b in self.buckets if not b.params_on_host]
        )
        grads = size(
            [self.grad_data]
            if self.grad_data is not None
            else [b.grad_shard for b in self.buckets if not b.grads_on_host]
        )
        return params, grads

    def resident_bytes(self) -> tuple[int, int]:
        """(parameter bytes, gradient bytes) this buffer holds on the device now: whole buffers, or
        the device shards plus the buckets gathered / being filled at the moment."""

        def size(t):
            return t.untyped_storage().nbytes()

        if self.param_data is not None:
            params = size(self.param_data)
        else:
            params = sum(size(b.param) + (0 if b.params_on_host else size(b.param_shard)) for b in self.buckets)
        if self.grad_data is not None:
            grads = size(self.grad_data)
        else:
            grads = sum(size(b.grad) + (0 if b.grads_on_host else size(b.grad_shard)) for b in self.buckets)
        return params, grads

    def local_grads(self, predicate=None) -> list[torch.Tensor]:
        """Views of the local shard of the gradient of every parameter for which `predicate(param)`
        holds (all when None), in buffer order: the same order and sizes on every rank whose
        buffers have the same layout, so such ranks can reduce them together."""
        out = []
        for index, bucket in enumerate(self.buckets):
            for piece in self.layout.pieces(index, self.shard_rank):
                if predicate is None or predicate(self.params[piece.name]):
                    out.append(bucket.grad_shard[piece.shard_start : piece.shard_end])
        return out
