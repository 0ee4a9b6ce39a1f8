"""The global batch size as a function of samples consumed, and the training length.

Megatron's two ways of growing the batch, both decided by the samples consumed so far:
- `--rampup-batch-size START INCREMENT SAMPLES`: from START, add INCREMENT every
  SAMPLES / ((G - START) / INCREMENT) samples until SAMPLES are consumed, then G.
- `--step-batch-size-schedule "THRESHOLD:BS ..."`: batch size BS from THRESHOLD on, thresholds
  in tokens (divided by the sequence length, as Megatron does) with optional K/M/B/T suffixes.
The data order stays a pure function of the samples consumed: iteration i reads the samples
after those consumed by iterations 1..i-1. A run resumed with other batch sizes than the
saving run's continues from the saved count (`resume_at`), as Megatron does.
"""

from __future__ import annotations

SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _number(text: str) -> int:
    text = text.strip().upper()
    multiplier = SUFFIXES.get(text[-1:], 1)
    return int(float(text[:-1] if multiplier > 1 else text) * multiplier)


def parse_step_schedule(text: str, seq_length: int) -> tuple[tuple[int, int], ...]:
    """'0:16 2.4B:320' -> ((0, 16), (2.4e9 // seq_length, 320)): (threshold in samples, batch size)."""
    steps = []
    for entry in text.replace(",", " ").split():
        threshold, sep, batch = entry.partition(":")
        try:
            steps.append((_number(threshold) // seq_length, _number(batch)))
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--step-batch-size-schedule: bad entry {entry!r}; expected THRESHOLD:BATCH_SIZE")
    steps.sort()
    if not steps or steps[0][0] != 0:
        raise ValueError("--step-batch-size-schedule must start with a threshold of 0")
    if any(a[0] == b[0] for a, b in zip(steps, steps[1:])):
        raise ValueError("--step-batch-size-schedule thresholds must differ (in samples)")
    return tuple(steps)


class BatchSizeSchedule:
    def __init__(
        self,
        global_batch_size: int,
        *,
        rampup: tuple[int, int, int] | None = None,
        steps: tuple[tuple[int, int], ...] = (),
    ):
        self.global_batch_size, self.rampup, self.steps = global_batch_size, rampup, steps
        self._first = 1  # the first iteration this schedule counts from (> 1 after `resume_at`)
        self._consumed = [0]  # samples consumed before iteration self._first + i, grown on demand
        self._updates = (0, 0)  # (successful updates, the learning-rate clock's samples) at self._first
        if rampup is not None:
            start, increment, samples = rampup
            if start < 1 or increment < 1 or samples < 0:
                raise ValueError("--rampup-batch-size needs START >= 1, INCREMENT >= 1 and SAMPLES >= 0")
            if start > global_batch_size or (global_batch_size - start) % increment:
                raise ValueError(
                    f"--rampup-batch-size: --global-batch-size ({global_batch_size}) - START ({start}) "
                    f"must be a non-negative multiple of INCREMENT ({increment})"
                )

    @property
    def constant(self) -> bool:
        return self.rampup is None and not self.steps

    def sizes(self) -> list[int]:
        """Every global batch size the schedule can produce."""
        if self.steps:
            return [size for _, size in self.steps]
        if self.rampup:
            return list(range(self.rampup[0], self.global_batch_size + 1, self.rampup[1]))
        return [self.global_batch_size]

    def at(self, consumed: int) -> int:
        """The global batch size of the iteration that starts after `consumed` samples."""
        if self.steps:
            return [size for threshold, size in self.steps if consumed >= threshold][-1]
        if self.rampup is None or self.rampup[0] == self.global_batch_size or consumed > self.rampup[2]:
            return self.global_batch_size
        start, increment, samples = self.rampup
        per_increment = samples / ((self.global_batch_size - start) // increment)
        return start + int(consumed / per_increment) * increment

    def resume_at(self, iteration: int, consumed: int, updates: int, update_samples: int) -> None:
        """Continue a run saved after `iteration` with `consumed` samples read, `updates` successful
        updates and the learning-rate clock at `update_samples` (see `update_samples`), whatever batch
        sizes it used: iteration `iteration` + 1 reads from sample `consumed` on, each later one after
        its predecessor's batch, sized by this schedule at the samples consumed."""
        self._first, self._consumed, self._updates = iteration + 1, [consumed], (updates, update_samples)

    def consumed_before(self, iteration: int) -> int:
        """Samples consumed by iterations 1..iteration-1 (1-based iterations)."""
        offset = iteration - self._first
        if offset < 0:
            raise ValueError(f"iteration {iteration} precedes the resumed run's first ({self._first})")
        if self.constant:
            return self._consumed[0] + offset * self.global_batch_size
        while len(self._consumed) <= offset:
            self._consumed.append(self._consumed[-1] + self.at(self._consumed[-1]))
        return self._consumed[offset]

    def update_samples(self, updates: int) -> int:
        """The learning-rate schedule's clock after `updates` successful updates: Megatron advances it by
        the global batch size of each successful update only. Counted from the resume point: the saved
        clock plus the samples of the iterations since, the k-th update after it taken as the k-th
        iteration's (exact unless an fp16 iteration was skipped while the batch size changed)."""
        saved_updates, saved_samples = self._updates
        return saved_samples + self.consumed_before(self._first + updates - saved_updates) - self._consumed[0]

    def iterations_for(self, train_samples: int) -> int:
        """--train-samples -> iterations, as Megatron counts: G-sized batches rounded down; with a
        step schedule until the samples are reached; with a ramp-up, the ramp's iterations (while
        consumed <= ramp samples) plus whole G-sized batches for the rest."""
        if self.constant:
            return train_samples // self.global_batch_size
        iterations = consumed = 0
        while consumed < train_samples if self.steps else consumed <= self.rampup[2]:
            consumed += self.at(consumed)
            iterations += 1
        if self.rampup is not None:
            iterations += max(0, train_samples - consumed) // self.global_batch_size
        return iterations
