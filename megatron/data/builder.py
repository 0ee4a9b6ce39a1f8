"""Train/valid/test datasets from a DataConfig, following megatron-core's blended dataset builder.

For each split:
- one prefix without weights: a GPTDataset of at least the requested samples;
- weighted prefixes: each prefix's GPTDataset holds ceil(ceil(n * w) * 1.005) samples (a small
  surplus so the greedy blend never runs short) and the blend has sum(ceil(n * w)) samples;
- bare prefixes: each GPTDataset is one epoch and the blend takes min(n, all of them)
  samples with weights proportional to the datasets' lengths (exhaustively when n is None);
- a split asked for 0 samples, whose --split share is 0, or that has no --<split>-data-path
  is None.
With --data-path every prefix's documents are divided by --split; with
--train/valid/test-data-path each split uses all documents of its own prefixes.

The builder process builds and caches every index; the others call `barrier` with it and
then load the cached files, so expensive work runs once per job.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from megatron.data.blended_dataset import BlendedDataset, normalize
from megatron.data.config import SPLIT_NAMES, Blend, DataConfig
from megatron.data.gpt_dataset import GPTDataset, default_cache_dir
from megatron.data.indexed_dataset import IndexedDataset


def build_datasets(
    config: DataConfig,
    tokenizer,
    seq_length: int,
    seed: int,
    train_samples: int | None,
    valid_samples: int | None,
    test_samples: int | None,
    is_builder: bool = True,
    barrier: Callable[[], None] | None = None,
) -> tuple:
    """(train, valid, test) datasets, each None or with __len__ and __getitem__ -> sample dict.

    `tokenizer` gives the EOD id and the vocabulary the tokens must fit; None (for tools that
    only look at token ids) skips both, which rules out --eod-mask-loss and the reset flags.

    Every process calls this with the same arguments; exactly one passes is_builder=True.
    With several processes pass a `barrier` (e.g. torch.distributed.barrier): the builder
    builds first, then all meet at the barrier, then the others load the cache.
    """
    sizes = [train_samples, valid_samples, test_samples]
    builder = _Builder(config, tokenizer, seq_length, seed)
    datasets = builder.build(sizes, is_builder=True) if is_builder else None
    if barrier is not None:
        barrier()
    if not is_builder:
        datasets = builder.build(sizes, is_builder=False)
    return datasets


def _sizes_per_dataset(weights: list[float], size: int, surplus: float = 0.0) -> list[int]:
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


class _Builder:
    def __init__(self, config: DataConfig, tokenizer, seq_length: int, seed: int):
        self.config, self.tokenizer, self.seq_length, self.seed = config, tokenizer, seq_length, seed
        self._indexed: dict[str, IndexedDataset] = {}

    def build(self, sizes: list[int | None], is_builder: bool) -> tuple:
        self.is_builder = is_builder
        if self.config.blend is not None:
            return tuple(
                self._split(self.config.blend, i, self.config.split_bounds[i], sizes[i])
                if self.config.split_bounds[i] is not None
                else None
                for i in range(3)
            )
        return tuple(
            self._split(blend, i, (0.0, 1.0), sizes[i]) if blend is not None else None
            for i, blend in enumerate(self.config.blend_per_split)
        )

    def _split(self, blend: Blend, split: int, bounds: tuple[float, float], size: int | None):
        if size == 0:
            return None
        name = SPLIT_NAMES[split]
        per_split = self.config.blend is None
        if len(blend.prefixes) == 1 and (blend.weights is None or per_split):
            return self._gpt(blend.prefixes[0], name, bounds, size)
        if blend.weights is None:
            datasets = [self._gpt(prefix, name, bounds, None) for prefix in blend.prefixes]
            total = sum(len(d) for d in datasets)
            return self._blend(datasets, None, None if size is None else min(size, total), name)
        if size is None:
            raise ValueError(f"the {name} split of a weighted blend needs a sample count")
        weights = normalize(blend.weights)
        target = _sizes_per_dataset(weights, size)
        buffer = _sizes_per_dataset(weights, size, self.config.mid_level_dataset_surplus)
        datasets = [self._gpt(prefix, name, bounds, n) for prefix, n in zip(blend.prefixes, buffer)]
        return self._blend(datasets, weights, sum(target), name)

    def _blend(self, datasets, weights, size, name):
        return BlendedDataset(
            datasets, weights, size, split_name=name, cache_dir=self.config.cache_path, is_builder=self.is_builder
        )

    def _gpt(self, prefix: str, name: str, bounds: tuple[float, float], num_samples: int | None) -> GPTDataset:
        indexed = self._open(prefix)
        begin, end = (int(round(b * float(len(indexed)))) for b in bounds)
        config = self.config
        return GPTDataset(
            indexed,
            np.arange(begin, end, dtype=np.int32),
            num_samples,
            split_name=name,
            seq_length=self.seq_length,
            seed=self.seed,
            eod=None if self.tokenizer is None else self.tokenizer.eod,
            eod_mask_loss=config.eod_mask_loss,
            reset_position_ids=config.reset_position_ids,
            reset_attention_mask=config.reset_attention_mask,
            cache_dir=config.cache_path or default_cache_dir(prefix),
            is_builder=self.is_builder,
            vocab_size=None if self.tokenizer is None else self.tokenizer.vocab_size,
        )

    def _open(self, prefix: str) -> IndexedDataset:
        """Each prefix opened once (its tokens are checked against the vocabulary as samples are read)."""
        if prefix not in self._indexed:
            self._indexed[prefix] = IndexedDataset(prefix)
        return self._indexed[prefix]
