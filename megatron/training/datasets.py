"""The train / validation / test datasets of a run: mock data, or Megatron's indexed data.

Indexed data: rank 0 builds (and caches) every index first; a failure there (a corrupt
file, tokens outside the vocabulary, a split too small) is sent to every rank, so all
stop with the same one-line error instead of waiting forever; then the other ranks
load the cached indices.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron.core.errors import AgreedError
from megatron.data.builder import build_datasets
from megatron.data.mock import MockGPTDataset
from megatron.data.tokenizers import build_tokenizer


def split_sample_counts(run) -> tuple[int, int, int]:
    """Samples each split must hold: the training run, every validation pass, one test pass."""
    training, evaluation = run.training, run.evaluation
    train = training.batch_schedule.consumed_before(training.train_iters + 1)
    valid = evaluation.evaluations(training.train_iters) * evaluation.iters * training.global_batch_size
    return train, valid, evaluation.iters * training.global_batch_size


def build_run_datasets(run) -> tuple:
    """(train, valid, test); valid/test may be None (a zero --split share, no path)."""
    model, seed = run.model, run.training.seed
    if run.data is None:
        return tuple(MockGPTDataset(model.vocab_size, model.seq_length, seed + split) for split in range(3))
    tokenizer = build_tokenizer(**run.data.tokenizer_args())
    counts = split_sample_counts(run)
    error, datasets = None, None
    if dist.get_rank() == 0:
        try:
            datasets = build_datasets(run.data, tokenizer, model.seq_length, seed, *counts, is_builder=True)
            error = _too_short(datasets, counts)
        except (ValueError, OSError) as failure:
            error = str(failure)
    shared = [error]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] is not None:
        raise AgreedError(shared[0])
    if datasets is None:
        datasets = build_datasets(run.data, tokenizer, model.seq_length, seed, *counts, is_builder=False)
    return datasets


def _too_short(datasets, counts) -> str | None:
    for name, dataset, needed in zip(("train", "validation", "test"), datasets, counts):
        if dataset is not None and len(dataset) < needed:
            return (
                f"the {name} split holds {len(dataset)} samples but the run needs {needed}; give weights in "
                "--data-path, fewer iterations or a larger corpus"
            )
    if datasets[0] is None:
        return "the train split is empty: check --split and --data-path / --train-data-path"
    return None
