"""Several datasets drawn in fixed proportions, with megatron-core's greedy blending.

Blended sample i comes from the dataset whose share is furthest behind its weight at
step i (error = weight * max(i, 1) - samples taken so far; ties go to the lower index),
and is that dataset's next unused sample. Every prefix of the blend therefore stays
within about one sample of its target proportions, and the order is a pure function of
the weights and the size. Without a size (a bare --data-path list) each dataset's samples
are all taken exactly once, in proportion to their counts. The loops below are the
definition; the same loops compiled (blending_loop.py) build the indices, about two orders
of magnitude faster (tools/bench/blending.py), and the Python ones run only without a C compiler.
"""

from __future__ import annotations

import functools
import json
import sys

import numpy as np

from megatron.data import blending_loop
from megatron.data.index_cache import IndexCache


def normalize(weights) -> list[float]:
    """weights / sum(weights) in float64, summed as numpy sums (megatron-core's rounding)."""
    array = np.asarray(weights, dtype=np.float64)
    return (array / np.sum(array)).tolist()


@functools.cache
def _compiled_loop() -> bool:
    """True when the compiled loop is available; says once that the Python loop runs otherwise."""
    if blending_loop.native() is not None:
        return True
    print(
        "warning: no C compiler ($CC or cc) to build the blending loop; building blend indices in Python "
        "(minutes per 100M samples)",
        file=sys.stderr,
        flush=True,
    )
    return False


def build_blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16 [size], dataset_sample_index int64 [size]) for normalized weights."""
    if _compiled_loop():
        return blending_loop.run(weights, None, size)
    return python_blending_indices(weights, size)


def build_exhaustive_blending_indices(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """As build_blending_indices with weights proportional to `sizes`, taking exactly sizes[d]
    samples from dataset d (a dataset drops out once used up)."""
    if _compiled_loop():
        total = sum(sizes)
        return blending_loop.run([s / total for s in sizes], sizes, total)
    return python_exhaustive_blending_indices(sizes)


def python_blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """build_blending_indices as a Python loop."""
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    taken = [0] * len(weights)
    order = range(len(weights))
    for i in range(size):
        x = float(max(i, 1))
        best = max(order, key=lambda d: (weights[d] * x - taken[d], -d))
        dataset_index[i], sample_index[i] = best, taken[best]
        taken[best] += 1
    return dataset_index, sample_index


def python_exhaustive_blending_indices(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """build_exhaustive_blending_indices as a Python loop."""
    total = sum(sizes)
    weights = [s / total for s in sizes]
    dataset_index = np.zeros(total, dtype=np.int16)
    sample_index = np.zeros(total, dtype=np.int64)
    taken = [0] * len(sizes)
    unspent = [d for d in range(len(sizes)) if sizes[d] > 0]
    for i in range(total):
        x = float(max(i, 1))
        best = max(unspent, key=lambda d: (weights[d] * x - taken[d], -d))
        dataset_index[i], sample_index[i] = best, taken[best]
        taken[best] += 1
        if taken[best] == sizes[best]:
            unspent.remove(best)
    return dataset_index, sample_index


class BlendedDataset:
    """Item i is datasets[dataset_index[i]][dataset_sample_index[i]] plus "dataset_id"."""

    def __init__(
        self,
        datasets: list,
        weights: list[float] | None,
        size: int | None,
        *,
        split_name: str,
        cache_dir: str | None = None,
        is_builder: bool = True,
    ):
        """`weights` None with `size` None: exhaustive blend of all samples of all datasets.
        `weights` None with a size: weights proportional to the datasets' lengths."""
        if weights is None:
            weights = [float(len(d)) for d in datasets]
        if size is not None:
            weights = normalize(weights)
        self.datasets, self.weights, self.size, self.split_name = datasets, weights, size, split_name
        description = json.dumps(
            {
                "class": "BlendedDataset",
                "datasets": [json.loads(d.description) for d in datasets],
                "split": split_name,
                "weights": weights,
                "size": size,
            },
            indent=4,
        )
        self.description = description

        def build():
            if size is None:
                index, sample = build_exhaustive_blending_indices([len(d) for d in datasets])
            else:
                index, sample = build_blending_indices(weights, size)
            counts = np.bincount(index, minlength=len(datasets))
            for d, (dataset, count) in enumerate(zip(datasets, counts)):
                if count > len(dataset):
                    raise ValueError(
                        f"the {split_name} blend needs {count} samples from dataset {d} "
                        f"({dataset.indexed.prefix}) but it has only {len(dataset)}"
                    )
            return {"dataset_index": index, "dataset_sample_index": sample}

        cache = IndexCache(cache_dir, f"BlendedDataset-{split_name}", description)
        arrays = cache.get_or_build(["dataset_index", "dataset_sample_index"], build, is_builder)
        self.dataset_index, self.dataset_sample_index = arrays["dataset_index"], arrays["dataset_sample_index"]

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int) -> dict:
        dataset_id = int(self.dataset_index[index])
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][int(self.dataset_sample_index[index])]}

    def sample_tokens(self, index: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[index])].sample_tokens(int(self.dataset_sample_index[index]))
