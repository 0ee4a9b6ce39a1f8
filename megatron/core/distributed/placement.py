"""Where each memory chunk's state lives: on the device or in host memory (after PatrickStar).

A memory chunk is one bucket of a model chunk's buffers; this rank holds its shard. Three parts
of a shard can live in host memory, and each needs the one before it there (the sets nest):
- optimizer state: fp32 master weights, Adam m and v, and the gradient's host copy, stepped by
  the CPU (`--optimizer-cpu-offload`, `--optimizer-offload-fraction`);
- the fp32 gradient shard (sharded gradients, `--grad-offload-fraction`): each microbatch's
  reduce-scattered gradient is copied to host and added there, and the CPU step reads it in
  place, so the optimizer's own gradient copy is this shard (no extra bytes, no copy at the step);
- the parameter shard (sharded parameters, `--param-offload-fraction`): copied to the device
  into the gathered bucket each time the bucket is gathered; the CPU step writes it in place.

Chunks are ordered by when the next forward needs them (`forward_order`); the host takes chunks
from the end of that order (the forward reaches them last, so their CPU step hides longest).

What a part costs on host, in bytes moved per step per device byte it frees (m microbatches):
optimizer state 0.5 (4 down and 2 up per step for 12 bytes, bf16), gradients m (4 down per
microbatch for 4), parameters m to 2m (2 up per gather, one or two gathers per microbatch, for
2). So the auto policy (`auto_placement`) keeps parameters on the device first, then gradients,
then optimizer state, each front of the order first, as far as the device budget allows, after
making the host part fit the host budget.
"""

from __future__ import annotations

from dataclasses import dataclass

PARTS = ("optimizer", "grads", "params")
HOST_OPTIMIZER_TENSORS = 4  # fp32 elements per host element: master, exp_avg, exp_avg_sq, gradient
ADD_STAGING_SLOTS = 2  # host copies of reduce-scattered gradients waiting to be added (double buffer)


@dataclass(frozen=True)
class Placement:
    """Shard indices (build_shards' order: buffer by buffer, buckets in backward order) whose
    part lives in host memory."""

    optimizer: frozenset = frozenset()
    grads: frozenset = frozenset()
    params: frozenset = frozenset()

    def __post_init__(self):
        if not self.params <= self.grads <= self.optimizer:
            raise ValueError(
                "host-resident parts must nest: a chunk's parameters on host need its gradient there, "
                "and its gradient needs its optimizer state there"
            )

    @property
    def any(self) -> bool:
        return bool(self.optimizer)

    def counts(self) -> dict[str, int]:
        return {part: len(getattr(self, part)) for part in PARTS}


def forward_order(buffers: list) -> list[int]:
    """Shard indices in the order the next forward uses them (`buffers`: ParamAndGradBuffers or
    BufferLayouts, each with `.buckets` in backward order)."""
    order, first = [], 0
    for buffer in buffers:
        order += list(reversed(range(first, first + len(buffer.buckets))))
        first += len(buffer.buckets)
    return order


def chunks_at_end(order: list[int], numels: list[int], fraction: float) -> frozenset:
    """The chunks at the end of `order` whose elements come nearest to `fraction` of all (a smaller
    fraction takes a subset, so the parts' sets nest when their fractions do)."""
    target, taken, out = fraction * sum(numels), 0, set()
    for index in reversed(order):
        if taken + numels[index] / 2 >= target:
            break
        taken += numels[index]
        out.add(index)
    return frozenset(out)


def static_placement(
    order: list[int], numels: list[int], optimizer: float, grads: float = 0.0, params: float = 0.0
) -> Placement:
    """The static policy: each part's fraction taken from the end of the order."""
    return Placement(*(chunks_at_end(order, numels, f) for f in (optimizer, grads, params)))


def shard_numels(layouts: list) -> list[int]:
    """This rank's shard of each bucket, in build_shards' order (`layouts`: the BufferLayouts of
    the rank's chunks, a ParamAndGradBuffer's `.layout` or the estimator's own)."""
    return [bucket.shard_numel for layout in layouts for bucket in layout.buckets]


def chunk_placement(layouts: list, optimizer: float, grads: float = 0.0, params: float = 0.0) -> Placement:
    """What the static policy places on host for these fractions on a rank's chunks (`layouts`:
    their BufferLayouts): the one placement the trainer runs and the memory estimate counts."""
    return static_placement(forward_order(layouts), shard_numels(layouts), optimizer, grads, params)


@dataclass(frozen=True)
class PartBytes:
    """Device bytes per element of each part when it stays on the device; 0 for a part that
    cannot move under the sharding strategy (whole buffers are not placed per chunk)."""

    optimizer: int
    grads: int = 0
    params: int = 0

    def movable(self) -> tuple[str, ...]:
        return tuple(part for part in PARTS if getattr(self, part))


def part_bytes(model_dtype_bytes: int, shards_grads: bool, shards_params: bool, grad_dtype_bytes: int = 4) -> PartBytes:
    """Optimizer state: Adam's moments plus an fp32 master unless the weights are fp32."""
    return PartBytes(
        optimizer=8 + (0 if model_dtype_bytes == 4 else 4),
        grads=grad_dtype_bytes if shards_grads else 0,
        params=model_dtype_bytes if shards_params else 0,
    )


def host_elements(numels: list[int], placement: Placement, model_dtype_bytes: int) -> int:
    """fp32 elements of the host slab: four per optimizer-state element on host (the resident
    gradient shard is the fourth), the parameter shards in the model dtype (each rounded up to
    whole fp32 elements), and the staging slots of the gradient additions."""
    optimizer = HOST_OPTIMIZER_TENSORS * sum(numels[i] for i in placement.optimizer)
    params = sum(-(-numels[i] * model_dtype_bytes // 4) for i in placement.params)
    staging = ADD_STAGING_SLOTS * max((numels[i] for i in placement.grads), default=0)
    return optimizer + params + staging


@dataclass(frozen=True)
class AutoDecision:
    placement: Placement
    budget_bytes: int | None
    fixed_bytes: int  # device bytes nothing moves: activations, transients, whole buffers, gathered buckets
    margin_bytes: int
    kept_bytes: int  # movable parts kept on the device
    host_bytes: int
    chunks: int
    host_budget_bytes: int | None = None

    @property
    def room_bytes(self) -> int | None:
        """Device bytes the movable parts may take (None: no limit known)."""
        return None if self.budget_bytes is None else self.budget_bytes - self.fixed_bytes - self.margin_bytes

    @property
    def spare_bytes(self) -> int | None:
        """Device room the placement left over (None: no limit known): what a forward may keep of
        its gathered buckets for its backward (param_gather.BucketHooks.keep_gathered)."""
        return None if self.room_bytes is None else max(0, self.room_bytes - self.kept_bytes)

    @property
    def fits(self) -> bool:
        device = self.room_bytes is None or self.kept_bytes <= self.room_bytes
        return device and (self.host_budget_bytes is None or self.host_bytes <= self.host_budget_bytes)

    def describe(self) -> str:
        return "> offload policy auto: " + self.summary()

    def summary(self) -> str:
        counts = {part: self.chunks - n for part, n in self.placement.counts().items()}
        kept = ", ".join(
            f"{name} of {counts[part]}/{self.chunks} chunks"
            for part, name in (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"))
        )
        host = f"on host {_size(self.host_bytes)}" + (
            f" of {_size(self.host_budget_bytes)} (--host-memory-gb)" if self.host_budget_bytes is not None else ""
        )
        if self.budget_bytes is None:
            return f"no device memory limit known (CPU without --device-memory-gb): {kept} on the device; {host}"
        return (
            f"budget {_size(self.budget_bytes)} - fixed {_size(self.fixed_bytes)} "
            f"(activations, transients, buffers not placed per chunk) - margin {_size(self.margin_bytes)}: on the "
            f"device {kept} ({_size(self.kept_bytes)}); {host}"
            + ("" if self.fits else "; DOES NOT FIT")
            + f"; spare {_size(self.spare_bytes)}"
        )


AUTO_MARGIN = 0.10  # of the device budget: allocator fragmentation and what the estimate does not show


def auto_placement(
    order: list[int],
    numels: list[int],
    costs: PartBytes,
    budget_bytes: int | None,
    fixed_bytes: int,
    model_dtype_bytes: int,
    host_budget_bytes: int | None = None,
) -> AutoDecision:
    """Each chunk gets a level: how many of its parts, in PARTS order, live on host. All start at
    the highest the strategy allows (the least device memory). Then
    1. while the host slab exceeds `host_budget_bytes`: parameters come back to the device
       (front of the order first), then whole chunks: a byte of host memory saved costs a byte
       of device memory either way, and keeping a gradient on the device saves no host memory
       (the host gradient is the optimizer's own gradient copy);
    2. while it fits under budget - fixed - margin: parameters come back, then gradients, then
       optimizer state (see the module docstring for why), each phase stopping at the first chunk
       that does not fit."""
    movable = costs.movable()
    top = len(movable)
    level = dict.fromkeys(order, top)
    part_cost = [getattr(costs, part) for part in PARTS]

    def placement() -> Placement:
        return Placement(*(frozenset(i for i in order if level[i] > k) for k in range(len(PARTS))))

    def kept() -> int:
        return sum(part_cost[k] * numels[i] for i in order for k in range(level[i], top))

    def host() -> int:
        return 4 * host_elements(numels, placement(), model_dtype_bytes)

    margin = 0 if budget_bytes is None else int(AUTO_MARGIN * budget_bytes)
    room = None if budget_bytes is None else budget_bytes - fixed_bytes - margin
    if host_budget_bytes is not None:
        for target in ([top - 1] if top == len(PARTS) else []) + [0]:
            for index in order:
                if host() <= host_budget_bytes:
                    break
                level[index] = min(level[index], target)
    for target in reversed(range(top)):
        for index in order:
            if level[index] <= target:
                continue
            before = level[index]
            level[index] = target
            if room is not None and kept() > room:
                level[index] = before
                break
        if any(level[i] > target for i in order):
            break
    return AutoDecision(placement(), budget_bytes, fixed_bytes, margin, kept(), host(), len(order), host_budget_bytes)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"
