"""A local Hugging Face tokenizer directory (--tokenizer-model DIR) through transformers.AutoTokenizer.

Files are read from the directory only (local_files_only): nothing is downloaded at run time.
As in Megatron, the vocabulary is len(tokenizer) (added tokens included) and EOD is EOS.
"""

from __future__ import annotations


class HuggingFaceTokenizer:
    def __init__(self, path: str):
        try:
            import transformers
        except ImportError:
            raise ValueError(
                "--tokenizer-type HuggingFaceTokenizer needs the transformers package (pip install transformers)"
            ) from None
        try:
            self._tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as error:
            raise ValueError(
                f"--tokenizer-model {path}: not a Hugging Face tokenizer directory ({str(error).splitlines()[0]})"
            ) from None
        self.vocab_size = len(self._tok)
        self.bos = self._tok.bos_token_id
        self.eos = self._tok.eos_token_id
        if self.eos is None:
            raise ValueError(f"--tokenizer-model {path}: the tokenizer has no eos_token to use as EOD")
        self.eod = self.eos

    def tokenize(self, text: str) -> list[int]:
        return self._tok(text).input_ids

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])
