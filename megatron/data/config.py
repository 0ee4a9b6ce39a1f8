"""What the data pipeline needs to know, validated once: blends, split, cache, tokenizer, masking.

Blends are spelled as in Megatron's --data-path: either weights and prefixes interleaved
("0.3 A 0.7 B") or bare prefixes ("A B"). Weighted blends draw from each prefix in
proportion to its weight; a bare list draws each prefix's samples once (weights
proportional to each dataset's size), as megatron-core does.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from megatron.data.indexed_dataset import data_file_path, index_file_path

SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True)
class Blend:
    prefixes: list[str]
    weights: list[float] | None  # None: a bare list of prefixes

    @classmethod
    def parse(cls, values: list[str], flag: str = "--data-path") -> Blend:
        """Megatron's reading of a blend list: an even count whose every other item is a
        number is weights and prefixes; anything else is a list of prefixes."""
        if not values:
            raise ValueError(f"{flag} needs at least one prefix")
        if len(values) % 2 == 0:
            try:
                weights = [float(w) for w in values[0::2]]
            except ValueError:
                weights = None
            if weights is not None:
                if any(w <= 0 for w in weights):
                    raise ValueError(f"{flag}: weights must be > 0, got {values[0::2]}")
                return cls([p.strip() for p in values[1::2]], weights)
        return cls([p.strip() for p in values], None)


def parse_split(split: str) -> list[float]:
    """'969,30,1' -> normalized [train, valid, test] shares (missing trailing shares are 0)."""
    shares = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not 1 <= len(shares) <= 3 or sum(shares) <= 0:
        raise ValueError(f"--split {split!r}: expected up to three non-negative shares such as '969,30,1'")
    shares += [0.0] * (3 - len(shares))
    total = sum(shares)
    return [s / total for s in shares]


def split_matrix(split: str) -> list[tuple[float, float] | None]:
    """Each split's [begin, end) fraction of the documents, None for an empty share."""
    bounds, start = [], 0.0
    for share in parse_split(split):
        end = start + share
        bounds.append((start, end) if end > start else None)
        start = end
    return bounds


def check_prefix(prefix: str, flag: str) -> None:
    for path in (data_file_path(prefix), index_file_path(prefix)):
        if not os.path.isfile(path):
            raise ValueError(f"{flag} {prefix}: {path} not found")


@dataclass
class DataConfig:
    """Data flags after validation.

    Either `blend` (with `split` dividing each prefix's documents into train/valid/test) or
    `blend_per_split` (one blend or None per split, from --train/valid/test-data-path).
    `cache_path` None puts GPTDataset index caches beside each prefix, as Megatron does.
    """

    blend: Blend | None = None
    blend_per_split: list[Blend | None] | None = None
    split: str = "969,30,1"
    cache_path: str | None = None
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    num_workers: int = 2
    mid_level_dataset_surplus: float = 0.005
    split_bounds: list[tuple[float, float] | None] = field(init=False)

    def __post_init__(self):
        if (self.blend is None) == (self.blend_per_split is None):
            raise ValueError("give either --data-path or --train-data-path/--valid-data-path/--test-data-path")
        self.split_bounds = split_matrix(self.split)
        if self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")
        blends = [self.blend] if self.blend is not None else self.blend_per_split
        flags = ["--data-path"] if self.blend is not None else [f"--{n}-data-path" for n in SPLIT_NAMES]
        for blend, flag in zip(blends, flags):
            for prefix in blend.prefixes if blend is not None else []:
                check_prefix(prefix, flag)

    def tokenizer_args(self) -> dict:
        """Keyword arguments of megatron.data.tokenizers.build_tokenizer."""
        return dict(
            tokenizer_type=self.tokenizer_type,
            vocab_file=self.vocab_file,
            merge_file=self.merge_file,
            tokenizer_model=self.tokenizer_model,
            vocab_size=self.vocab_size,
        )
