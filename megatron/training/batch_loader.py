"""The microbatches a rank reads, collated ahead of use by a small thread pool.

Which samples a microbatch holds is a pure function of (samples consumed before the
iteration, microbatch index, dp rank) (`megatron/data/batches.py`), so the loader can
start reading the next iteration's microbatches while this one computes. Only ranks
that read data ever ask, so only they prefetch: the first and last pipeline stage, and
every stage when the model needs per-sample positions or documents. The
time a rank waits for a batch that is not ready yet is recorded: the data-loader
stall the iteration log reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from megatron.core.context_parallel.sharding import shard as cp_shard
from megatron.core.pipeline_parallel.microbatch import Microbatch
from megatron.data.batches import collate, microbatch_indices


class BatchLoader:
    """`plan(iteration) -> (samples consumed before it, microbatches in it)`; `model_inputs`:
    the per-sample fields besides tokens, labels and loss mask (`batches.model_input_fields`)."""

    def __init__(
        self,
        dataset,
        device,
        mesh,
        micro_batch_size: int,
        plan: Callable[[int], tuple[int, int]],
        workers: int,
        model_inputs: tuple[str, ...] = (),
    ):
        self.dataset, self.device, self.mesh, self.model_inputs = dataset, device, mesh, model_inputs
        self.micro_batch_size, self.plan = micro_batch_size, plan
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="batch-loader")
        self.pending: dict[tuple[int, int], Future] = {}
        self.queued: set[int] = set()  # iterations whose microbatches are in `pending` or were taken
        self.wait_seconds = 0.0

    def _load(self, consumed: int, microbatch: int) -> Microbatch:
        indices = microbatch_indices(
            consumed,
            microbatch,
            micro_batch_size=self.micro_batch_size,
            dp_size=self.mesh.dp_size,
            dp_rank=self.mesh.dp_rank,
        )
        batch = collate([self.dataset[i] for i in indices], self.device, self.model_inputs)
        if self.mesh.cp_size == 1:
            return batch
        return Microbatch(
            *(None if t is None else cp_shard(t, self.mesh.cp_rank, self.mesh.cp_size, dim=1) for t in batch)
        )

    def _prefetch(self, iteration: int) -> None:
        if iteration in self.queued:
            return
        self.queued.add(iteration)
        consumed, microbatches = self.plan(iteration)
        for microbatch in range(microbatches):
            self.pending[(consumed, microbatch)] = self.pool.submit(self._load, consumed, microbatch)

    def batch_fn(self, iteration: int) -> Callable[[int], Microbatch]:
        """The executor's batch(microbatch) for `iteration`; asking for the first microbatch
        also queues every microbatch of this and the next iteration."""
        consumed, _ = self.plan(iteration)

        self.queued.discard(iteration - 2)  # long consumed: keep the set small

        def batch(microbatch: int) -> Microbatch:
            self._prefetch(iteration)
            self._prefetch(iteration + 1)
            future = self.pending.pop((consumed, microbatch), None)
            if future is None:  # asked again (first and last stage, or model chunks, on one rank): load again
                return self._load(consumed, microbatch)
            started = time.perf_counter()
            result = future.result()
            self.wait_seconds += time.perf_counter() - started
            return result

        return batch

    def take_wait_seconds(self) -> float:
        seconds, self.wait_seconds = self.wait_seconds, 0.0
        return seconds

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
