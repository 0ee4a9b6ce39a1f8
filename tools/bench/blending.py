#!/usr/bin/env python
"""Blend indices: the Python loop (the definition) vs the compiled loop that builds them, side by side.

    python tools/bench/blending.py [--samples 10e6] [--datasets 8]

Both build megatron-core's greedy blend of `--samples` samples over `--datasets` random weights
(the Python loop takes about a minute for 10M samples here), check they give the same indices,
and print their times. Last line: `ratio python/compiled: X`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from megatron.data.blended_dataset import build_blending_indices, normalize, python_blending_indices  # noqa: E402


def seconds(fn) -> tuple[float, tuple]:
    begin = time.perf_counter()
    out = fn()
    return time.perf_counter() - begin, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=float, default=10e6)
    parser.add_argument("--datasets", type=int, default=8)
    args = parser.parse_args()
    weights = normalize(np.random.default_rng(0).random(args.datasets) + 0.05)
    samples = int(args.samples)
    build_blending_indices(weights, 10)  # compiles once (cached across runs)
    compiled, ours = seconds(lambda: build_blending_indices(weights, samples))
    python, reference = seconds(lambda: python_blending_indices(weights, samples))
    assert all(np.array_equal(a, b) for a, b in zip(ours, reference)), "the two loops disagree"
    print(
        f"{args.datasets} datasets, {samples:,} samples, same indices: python {python:.1f} s, "
        f"compiled {compiled:.2f} s (100M samples: about {compiled * 1e8 / samples:.0f} s)"
    )
    print(f"ratio python/compiled: {python / compiled:.0f}")


if __name__ == "__main__":
    main()
