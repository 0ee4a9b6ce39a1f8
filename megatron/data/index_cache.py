"""Index arrays built once and cached as .npy files, keyed by the md5 of what they depend on.

A dataset describes everything its indices depend on in a text (the description); its
md5 names the cache files `<md5>-<Class>-<split>-<name>.npy` plus `...-description.txt`.
One process (the builder, rank 0 in training) builds and writes them; the others wait at
a barrier and then memory-map them. Each file is written under a temporary name and
renamed, and the description is renamed last, so its presence marks a complete cache.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import numpy as np


class IndexCache:
    def __init__(self, directory: str | None, stem: str, description: str):
        """`directory` None keeps the indices in memory only (each process builds its own)."""
        self.directory, self.description = directory, description
        digest = hashlib.md5(description.encode("utf-8")).hexdigest()
        self.base = f"{digest}-{stem}"

    def path(self, name: str) -> str:
        return os.path.join(self.directory, f"{self.base}-{name}")

    def complete(self) -> bool:
        return self.directory is not None and os.path.isfile(self.path("description.txt"))

    def load(self, names: list[str]) -> dict[str, np.ndarray]:
        arrays = {}
        for name in names:
            path = self.path(f"{name}.npy")
            if not os.path.isfile(path):
                raise ValueError(
                    f"{path}: index cache file missing although {self.path('description.txt')} marks the cache complete"
                )
            arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        return arrays

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            suffix = f".tmp{os.getpid()}"
            for name, array in arrays.items():
                with open(self.path(f"{name}.npy") + suffix, "wb") as f:
                    np.save(f, array, allow_pickle=False)
                os.replace(self.path(f"{name}.npy") + suffix, self.path(f"{name}.npy"))
            with open(self.path("description.txt") + suffix, "w") as f:
                f.write(self.description)
            os.replace(self.path("description.txt") + suffix, self.path("description.txt"))
        except OSError as error:
            raise ValueError(
                f"cannot write the dataset index cache in {self.directory} ({error.strerror}); "
                f"point --data-cache-path at a writable directory"
            ) from None

    def get_or_build(
        self, names: list[str], build: Callable[[], dict[str, np.ndarray]], is_builder: bool
    ) -> dict[str, np.ndarray]:
        """Load the cached arrays; the builder builds and saves them when the cache is incomplete.
        A non-builder finding no cache means the builder did not share its files (or failed)."""
        if self.directory is None:
            return build()
        if self.complete():
            return self.load(names)
        if not is_builder:
            raise ValueError(
                f"{self.path('description.txt')}: the dataset index cache is missing after the "
                f"builder rank ran; --data-cache-path must be a directory all ranks share"
            )
        arrays = build()
        self.save(arrays)
        return arrays
