"""Hugging Face model directories: lazy reads from safetensors, writes one layer per file.

Reading opens each safetensors file once (`safe_open`) and loads a tensor only when
asked, so a conversion holds about one layer in memory. Writing puts each group of
tensors (embeddings, one layer, the final norm and head) in its own
`model-0000i-of-0000n.safetensors` with the index transformers reads.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE = "model.safetensors"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
INDEX = "model.safetensors.index.json"


def read_json(path: str) -> dict:
    """A Hugging Face JSON file (config.json, the safetensors index)."""
    with open(path) as f:
        return json.load(f)


class SafetensorsReader:
    def __init__(self, directory: str):
        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            files = read_json(index)["weight_map"]
        elif os.path.isfile(os.path.join(directory, SINGLE)):
            files = None
        else:
            raise FileNotFoundError(f"{directory}: neither {SINGLE} nor {INDEX} (only safetensors are read)")
        self.directory = directory
        self.handles = {}
        if files is None:
            files = dict.fromkeys(self._open(SINGLE).keys(), SINGLE)
        self.files = files

    def _open(self, file: str):
        if file not in self.handles:
            self.handles[file] = safe_open(os.path.join(self.directory, file), framework="pt")
        return self.handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ValueError(f"{self.directory}: no tensor {name} in the safetensors files")
        return self._open(self.files[name]).get_tensor(name)

    def names(self) -> list[str]:
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.files:
            raise ValueError(f"{self.directory}: no tensor {name} in the safetensors files")
        return tuple(self._open(self.files[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self._open(self.files[name]).get_slice(name).get_dtype()]


def write_hf_files(directory: str, groups: list, config: dict, progress=None) -> None:
    """Write each group (a callable returning {HF name: tensor}) as one safetensors file, then the
    index and config.json."""
    os.makedirs(directory, exist_ok=True)
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: t.contiguous() for name, t in group().items()}
        save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        if progress is not None:
            progress.update(1)
    with open(os.path.join(directory, INDEX), "w") as handle:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle, indent=1)
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(config, handle, indent=1)
