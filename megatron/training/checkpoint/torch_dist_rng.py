"""RNG states in Megatron-LM's torch_dist checkpoints, read and written as Megatron-LM does.

Megatron-LM (`get_rng_state`, megatron/training/checkpointing.py) stores one ShardedObject `rng_state`
of global shape (pp, tp) at offset (pp rank, tp rank), replicated over the data-parallel (x context-
parallel) ranks, so the first of them writes it: DCP object `rng_state/shard_<pp rank>.<tp rank>_<pp>.<tp>`,
holding a list with one dict per rank of the data-parallel group only with `--data-parallel-random-init`
(else one): `random_rng_state`, `np_rng_state`, `torch_rng_state`, `cuda_rng_state` (the default CUDA
generator, which Megatron's hidden dropout draws from) and `rng_tracker_states` (its tracker's streams:
`model-parallel-rng` for dropout inside tensor-parallel regions, `data-parallel-rng`,
`expert-parallel-rng`). On load every data-parallel rank takes that dict.

Ours draw dropout from two streams per model chunk (replicated over tp, and per tp rank). Written: the
first chunk's streams as Megatron's (`cuda_rng_state` on the CPU is torch's generator, as the generator
there; `data-parallel-rng` and `expert-parallel-rng`, unused by a dense GPT's dropout, carry the replicated
stream), and every chunk's streams under our names in `framework_dropout_states` (Megatron-LM ignores the
key), so that ours resumes bit for bit in the same layout. Read: ours from that key; Megatron-LM's streams
when their generator states are of our device's kind (CUDA's are not the CPU's), else a log line.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from megatron.training.checkpoint.state import rng_states, set_rng_states
from megatron.training.checkpoint.torch_dist_common import read_object

OURS = "framework_dropout_states"


def rng_object_name(mesh) -> str:
    """This rank's DCP name of Megatron-LM's `rng_state` ShardedObject."""
    dims = mesh.dims
    return f"rng_state/shard_{mesh.pp_rank}.{mesh.tp_rank}_{dims.pp}.{dims.tp}"


def _streams(trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """(replicated, tensor-parallel) dropout stream states of the first model chunk."""
    states = trainer.chunks[0].module.decoder.rng_tracker.get_state()
    return states[False], states[True]


def megatron_rng_objects(trainer) -> dict[str, list]:
    """The `rng_state` object of this rank's (pp, tp) position, on the first data-parallel (x cp) rank;
    nothing on the others (Megatron's replicas)."""
    mesh = trainer.mesh
    if mesh.dp_rank or mesh.cp_rank:
        return {}
    replicated, tensor_parallel = _streams(trainer)
    cuda = trainer.device.type == "cuda"
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(trainer.device) if cuda else torch.get_rng_state(),
        "rng_tracker_states": {
            "model-parallel-rng": tensor_parallel,
            "data-parallel-rng": replicated,
            "expert-parallel-rng": replicated,
        },
        OURS: {name: s for name, s in rng_states(trainer).items() if name.startswith("rng.dropout.")},
    }
    return {rng_object_name(mesh): [[state]]}  # a ShardedObject is stored as the list of a rank's objects


def has_megatron_rng(objects) -> bool:
    """Whether a checkpoint with DCP items `objects` (names) holds Megatron-LM's RNG states."""
    return any(name.startswith("rng_state/shard_") for name in objects)


def load_megatron_rng(trainer, directory: str) -> str | None:
    """Set this rank's generators from the checkpoint's `rng_state` (the layout is the saving one).
    Returns a log line when Megatron-LM's dropout streams could not be taken, else None."""
    saved = read_object(directory, rng_object_name(trainer.mesh))
    state = saved[trainer.mesh.dp_rank if len(saved) > 1 else 0]
    note = None
    if OURS in state:
        set_rng_states(trainer, {**rng_states(trainer), **state[OURS]})
    else:
        replicated, tensor_parallel = _streams(trainer)
        theirs = (state["cuda_rng_state"], state["rng_tracker_states"]["model-parallel-rng"])
        if (replicated.shape, tensor_parallel.shape) == tuple(t.shape for t in theirs):
            trainer.chunks[0].module.decoder.rng_tracker.set_state({False: theirs[0], True: theirs[1]})
        else:
            note = "> Megatron-LM's dropout streams were saved on another device type: not loaded"
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if trainer.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng_state"], trainer.device)
    return note
