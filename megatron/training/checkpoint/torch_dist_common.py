"""common.pt and the byte objects (ShardedObjects) of a Megatron-LM torch_dist checkpoint, unpickled
with stand-ins for megatron's classes (megatron is never imported)."""

from __future__ import annotations

import io
import os
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader

from megatron.core.checkpointing import CheckpointError

COMMON = "common.pt"


class _OpaqueType(type):
    """The type of the stand-ins: `getattr(StandIn, "auto")` makes a stand-in member named "auto".

    Python 3.11 pickles an enum member by name (`getattr(AttnBackend, "auto")` when unpickled),
    3.10 and 3.12+ by value (`AttnBackend(5)`); Megatron-LM's args hold such members."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        member = cls.__new__(cls)
        member.name = name
        return member


class _Opaque(metaclass=_OpaqueType):
    """Stands in for a class of megatron's in common.pt (enums, configs): holds what was pickled."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.split(".")[0] == "megatron":
            return type(name, (_Opaque,), {"__module__": module})
        return super().find_class(module, name)


class _PickleModule:
    Unpickler = _Unpickler
    load = pickle.load


def read_common(directory: str) -> dict:
    """common.pt of a Megatron-LM checkpoint (a trusted file: it is unpickled, as Megatron-LM does)."""
    path = os.path.join(directory, COMMON)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (a Megatron-LM torch_dist checkpoint holds one)")
    try:
        return torch.load(path, map_location="cpu", pickle_module=_PickleModule, weights_only=False)
    except Exception as error:  # noqa: BLE001 - any unpickling failure is one line
        raise CheckpointError(f"{path}: unreadable ({type(error).__name__}: {error})") from None


def read_object(directory: str, name: str):
    """One DCP byte object of a torch_dist checkpoint (a ShardedObject), or None when absent."""
    storage = FileSystemReader(directory).read_metadata().storage_data
    found = [info for index, info in storage.items() if index.fqn == name]
    if not found:
        return None
    with open(os.path.join(directory, found[0].relative_path), "rb") as f:
        f.seek(found[0].offset)
        data = f.read(found[0].length)
    # megatron-core writes a ShardedObject as the list of a rank's objects under that key: one
    return torch.load(io.BytesIO(data), map_location="cpu", pickle_module=_PickleModule, weights_only=False)[0]
