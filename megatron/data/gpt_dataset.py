"""GPT training samples from an indexed dataset, in megatron-core's order (see gpt_indices.py).

Item k is a dict of tensors of length seq_length:
    tokens        int64  inputs
    labels        int64  next tokens (tokens shifted by one)
    loss_mask     float  1, or 0 where the input token is EOD with eod_mask_loss
    position_ids  int64  0..s-1, restarting after each EOD with reset_position_ids
    document_ids  int64  (only with reset_attention_mask) which document each position is in:
                         the count of EODs before it; a position attends only to earlier
                         positions of the same document, which is Megatron's reset mask
                         without materialising s x s
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from megatron.data.gpt_indices import build_gpt_indices
from megatron.data.index_cache import IndexCache
from megatron.data.indexed_dataset import IndexedDataset, data_file_path

INDEX_NAMES = ["document_index", "sample_index", "shuffle_index"]


def default_cache_dir(prefix: str) -> str:
    """Megatron's default place for a prefix's GPTDataset index cache."""
    return os.path.join(prefix, "cache", "GPTDataset_indices")


class GPTDataset:
    def __init__(
        self,
        indexed: IndexedDataset,
        documents: np.ndarray,
        num_samples: int | None,
        *,
        split_name: str,
        seq_length: int,
        seed: int,
        eod: int | None,
        eod_mask_loss: bool = False,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        cache_dir: str | None = None,
        is_builder: bool = True,
        vocab_size: int | None = None,
    ):
        """`documents`: the sequence ids of this split; `num_samples`: at least this many samples
        (None: one epoch). The indices are cached in `cache_dir` (None: kept in memory).
        `vocab_size`: each sample read is checked to hold only ids below it (a sample's worth of
        work, where a check at start-up would read every .bin in full at every launch)."""
        if seq_length < 2:
            raise ValueError(f"--seq-length must be >= 2, got {seq_length}")
        if eod is None and (eod_mask_loss or reset_position_ids or reset_attention_mask):
            raise ValueError(
                "--eod-mask-loss and --reset-position-ids/--reset-attention-mask need a tokenizer's EOD id"
            )
        self.indexed, self.split_name, self.seq_length = indexed, split_name, seq_length
        self.eod, self.eod_mask_loss, self.vocab_size = eod, eod_mask_loss, vocab_size
        self.reset_position_ids, self.reset_attention_mask = reset_position_ids, reset_attention_mask
        documents = np.asarray(documents, dtype=np.int32)
        self.description = json.dumps(
            {
                "class": "GPTDataset",
                "dataset_path": os.path.abspath(indexed.prefix),
                "sequences_in_file": len(indexed),
                "tokens_in_file": indexed.num_tokens,
                "documents": [int(documents[0]), int(documents[-1]) + 1] if len(documents) else [0, 0],
                "num_samples": num_samples,
                "index_split": split_name,
                "random_seed": seed,
                "sequence_length": seq_length,
                "add_extra_token_to_sequence": True,
            },
            indent=4,
        )
        lengths = indexed.sequence_lengths
        if not len(documents) or not np.any(lengths[documents]):
            raise ValueError(
                f"{indexed.prefix}: the {split_name} split holds no tokens "
                f"({len(documents)} of {len(indexed)} sequences); change --split or the data"
            )

        def build():
            return build_gpt_indices(lengths, documents, seq_length, num_samples, seed)

        cache = IndexCache(cache_dir, f"GPTDataset-{split_name}", self.description)
        arrays = cache.get_or_build(INDEX_NAMES, build, is_builder)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def sample_tokens(self, index: int) -> np.ndarray:
        """The seq_length + 1 token ids of sample `index` (int64)."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for a {self.split_name} dataset of {len(self)} samples")
        row = int(self.shuffle_index[index])
        (doc_beg, off_beg), (doc_end, off_end) = self.sample_index[row], self.sample_index[row + 1]
        doc_beg, off_beg, doc_end, off_end = int(doc_beg), int(off_beg), int(doc_end), int(off_end)
        if doc_beg == doc_end:
            parts = [self.indexed.get(int(self.document_index[doc_beg]), off_beg, off_end - off_beg + 1)]
        else:
            parts = [self.indexed.get(int(self.document_index[doc_beg]), off_beg)]
            parts += [self.indexed.get(int(self.document_index[i])) for i in range(doc_beg + 1, doc_end)]
            parts.append(self.indexed.get(int(self.document_index[doc_end]), 0, off_end + 1))
        tokens = np.concatenate(parts).astype(np.int64)
        if self.vocab_size is not None and tokens.max() >= self.vocab_size:
            raise ValueError(
                f"{data_file_path(self.indexed.prefix)}: token id {tokens.max()} (in {self.split_name} "
                f"sample {index}) is outside the tokenizer's vocabulary of {self.vocab_size} ids; was "
                f"it preprocessed with another tokenizer?"
            )
        return tokens

    def __getitem__(self, index: int) -> dict:
        text = torch.from_numpy(self.sample_tokens(index))
        tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        is_eod = tokens == self.eod if self.eod is not None else torch.zeros(self.seq_length, dtype=torch.bool)
        loss_mask = torch.ones(self.seq_length, dtype=torch.float)
        if self.eod_mask_loss:
            loss_mask[is_eod] = 0.0
        item = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}
        positions = torch.arange(self.seq_length, dtype=torch.long)
        if self.reset_position_ids:
            # each position minus the start of its document (the position after the last EOD)
            starts = torch.where(torch.roll(is_eod, 1), positions, 0)
            starts[0] = 0
            positions = positions - torch.cummax(starts, 0).values
        item["position_ids"] = positions
        if self.reset_attention_mask:
            # a document starts after each EOD: count the EODs strictly before each position
            item["document_ids"] = torch.cumsum(is_eod.long(), 0) - is_eod.long()
        return item
