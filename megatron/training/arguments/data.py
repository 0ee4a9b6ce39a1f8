"""Megatron's data and tokenizer flags -> DataConfig. Nothing else reads these flags.

--vocab-size (NullTokenizer's vocabulary) and --mock-data are model/training flags defined
elsewhere; `data_config_from_args` reads args.vocab_size when present.
"""

from __future__ import annotations

import argparse

from megatron.data.config import Blend, DataConfig
from megatron.data.tokenizers import TOKENIZER_TYPES


def add_tokenizer_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--tokenizer-model", help="SentencePiece .model file, or a Hugging Face tokenizer directory")
    return parser


def add_data_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The data flags and the tokenizer flags (without --vocab-size)."""
    g = parser.add_argument_group("data")
    g.add_argument(
        "--data-path", nargs="*", help="prefixes of .bin/.idx files, optionally weighted: '0.3 A 0.7 B' or 'A B'"
    )
    g.add_argument("--split", default="969,30,1", help="train,valid,test shares of each --data-path prefix")
    g.add_argument("--train-data-path", nargs="*", help="the train blend, instead of --data-path and --split")
    g.add_argument("--valid-data-path", nargs="*", help="the validation blend")
    g.add_argument("--test-data-path", nargs="*", help="the test blend")
    g.add_argument("--data-cache-path", help="where index caches go (default: beside each prefix)")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on positions whose input is EOD")
    g.add_argument("--reset-position-ids", action="store_true", help="positions restart after each EOD")
    g.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="tokens attend only within their document (samples carry document_ids)",
    )
    g.add_argument("--num-workers", type=int, default=2, help="data loader worker processes")
    return add_tokenizer_arguments(parser)


def data_config_from_args(args) -> DataConfig:
    """Validate the data flags; every problem is one ValueError line naming the flag."""
    per_split = [args.train_data_path, args.valid_data_path, args.test_data_path]
    if args.data_path and any(p is not None for p in per_split):
        raise ValueError("give either --data-path or --train-data-path/--valid-data-path/--test-data-path, not both")
    if not args.data_path and all(p is None for p in per_split):
        raise ValueError("no data: pass --data-path (or --train-data-path with --valid/--test-data-path)")
    if args.data_path:
        blend, blend_per_split = Blend.parse(args.data_path), None
    else:
        if args.train_data_path is None:
            raise ValueError("--valid-data-path/--test-data-path need --train-data-path")
        names = ["--train-data-path", "--valid-data-path", "--test-data-path"]
        blend, blend_per_split = (
            None,
            [Blend.parse(p, flag) if p is not None else None for p, flag in zip(per_split, names)],
        )
    return DataConfig(
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        cache_path=args.data_cache_path,
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        vocab_size=getattr(args, "vocab_size", None),
        eod_mask_loss=args.eod_mask_loss,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        num_workers=args.num_workers,
    )
