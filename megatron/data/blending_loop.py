"""The blending loop of blended_dataset.py compiled to native code, as megatron-core compiles its helpers.

The greedy order (sample i from the dataset furthest behind its weight) is sequential: each
choice depends on every earlier one, and for three or more datasets no closed form reproduces
it bit for bit (sorting the datasets' k-th samples by k / weight, or iterating a vectorised
guess to its fixed point, diverges within a few samples or needs one pass per sample). So the
loop itself runs natively: the C below is the Python loop line for line, in the same float64
arithmetic (no fused multiply-add), and gives the same indices (tests/unit/test_gpt_dataset.py
compares them). It is compiled with the system C compiler ($CC, else cc) on first use into
$XDG_CACHE_HOME/megatron-blending (else ~/.cache/...), keyed by the source's hash. Without a
compiler `native()` returns None and the caller runs the Python loop, saying so.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile

import numpy as np

SOURCE = r"""
#include <stdint.h>
/* sizes == 0: `size` samples by `weights`; else exactly sizes[d] samples of dataset d */
void blend(const double *weights, const int64_t *sizes, int64_t n, int64_t size,
           int16_t *dataset_index, int64_t *sample_index, int64_t *taken) {
    for (int64_t i = 0; i < size; ++i) {
        double x = i > 1 ? (double)i : 1.0;
        int64_t best = -1;
        double best_error = 0.0;
        for (int64_t d = 0; d < n; ++d) {
            if (sizes && taken[d] >= sizes[d]) continue;
            double error = weights[d] * x - (double)taken[d];
            if (best < 0 || error > best_error) { best = d; best_error = error; }
        }
        dataset_index[i] = (int16_t)best;
        sample_index[i] = taken[best]++;
    }
}
"""
_FLAGS = ["-O2", "-ffp-contract=off", "-fPIC", "-shared"]
_library = None


def _compile() -> ctypes.CDLL | None:
    digest = hashlib.sha256((SOURCE + " ".join(_FLAGS)).encode()).hexdigest()[:16]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    directory = os.path.join(cache, "megatron-blending")
    path = os.path.join(directory, f"blend-{digest}.so")
    try:
        if not os.path.isfile(path):
            os.makedirs(directory, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=directory) as tmp:
                source, built = os.path.join(tmp, "blend.c"), os.path.join(tmp, "blend.so")
                with open(source, "w") as f:
                    f.write(SOURCE)
                subprocess.run(
                    [os.environ.get("CC", "cc"), *_FLAGS, source, "-o", built],
                    check=True,
                    capture_output=True,
                    timeout=120,
                )
                os.replace(built, path)  # atomic: concurrent builders leave one whole library
        library = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError):
        return None
    pointer = ctypes.c_void_p
    library.blend.argtypes = [pointer, pointer, ctypes.c_int64, ctypes.c_int64, pointer, pointer, pointer]
    library.blend.restype = None
    return library


def native():
    """The compiled `blend` function (compiled once per process), or None without a C compiler."""
    global _library
    if _library is None:
        _library = _compile() or False
    return _library or None


def run(weights: list[float], sizes: list[int] | None, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) from the compiled loop."""
    weights_array = np.ascontiguousarray(weights, dtype=np.float64)
    sizes_array = None if sizes is None else np.ascontiguousarray(sizes, dtype=np.int64)
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    taken = np.zeros(len(weights_array), dtype=np.int64)
    native().blend(
        weights_array.ctypes.data,
        None if sizes_array is None else sizes_array.ctypes.data,
        len(weights_array),
        size,
        dataset_index.ctypes.data,
        sample_index.ctypes.data,
        taken.ctypes.data,
    )
    return dataset_index, sample_index
