"""A closed trainer frees its model: nothing outside the trainer keeps the parameters alive.

Autograd holds post-accumulate-grad hooks where the garbage collector cannot see them, and the
hooks reach the model; before `Trainer.close` released them, each trainer built in a process
(the GPU check builds many) kept its model and gradient buffer allocated, ~6 GiB per 1.1B run
on an H100."""

import gc
import weakref

from tests.distributed import run_distributed
from tests.parallel.layouts import build_trainer


def _model_freed(rank, flags):
    trainer = build_trainer("llama", flags)
    trainer.train_step(1)
    trainer.optimizer.wait_for_step()
    chunks = [weakref.ref(chunk) for chunk in trainer.chunks]
    trainer.close()
    del trainer
    gc.collect()
    return [chunk() is None for chunk in chunks]


def test_closed_trainer_frees_its_model():
    sharded = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    for flags in ([], sharded):
        assert run_distributed(2, _model_freed, flags) == [[True], [True]], flags
