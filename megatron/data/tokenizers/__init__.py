"""Tokenizers by Megatron's --tokenizer-type names, behind one small interface.

Every tokenizer has `vocab_size`, `tokenize(text) -> list[int]`, `detokenize(ids) -> str`
and `eod` (the id preprocess_data.py appends with --append-eod and the dataset masks with
--eod-mask-loss); `bos`/`eos` where the tokenizer defines them, else None.
"""

from __future__ import annotations

import os

from megatron.data.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron.data.tokenizers.huggingface import HuggingFaceTokenizer
from megatron.data.tokenizers.null import NullTokenizer
from megatron.data.tokenizers.spm import SentencePieceTokenizer

SP_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = ("GPT2BPETokenizer", *SP_TYPES, "HuggingFaceTokenizer", "NullTokenizer")

__all__ = [
    "TOKENIZER_TYPES",
    "build_tokenizer",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
]


def _existing(flag: str, path: str | None, tokenizer_type: str, *, directory: bool = False) -> str:
    if path is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    exists = os.path.isdir(path) if directory else os.path.isfile(path)
    if not exists:
        raise ValueError(f"{flag} {path}: no such {'directory' if directory else 'file'}")
    return path


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
):
    """The tokenizer named by Megatron's flags; a missing flag or file is one ValueError line."""
    if tokenizer_type is None:
        raise ValueError(f"--tokenizer-type is required: one of {', '.join(TOKENIZER_TYPES)}")
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(
            _existing("--vocab-file", vocab_file, tokenizer_type), _existing("--merge-file", merge_file, tokenizer_type)
        )
    if tokenizer_type in SP_TYPES:
        return SentencePieceTokenizer(
            _existing("--tokenizer-model", tokenizer_model, tokenizer_type), add_bos=tokenizer_type == "Llama2Tokenizer"
        )
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(_existing("--tokenizer-model", tokenizer_model, tokenizer_type, directory=True))
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r}: choose one of {', '.join(TOKENIZER_TYPES)}")
