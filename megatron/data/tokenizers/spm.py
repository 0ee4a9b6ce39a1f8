"""SentencePiece models (Megatron's SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer).

As in megatron-core, the vocabulary is the model's pieces, EOD is the model's EOS id and
BOS its BOS id. Llama2Tokenizer keeps Megatron-LM's behaviour of starting every tokenized
text with BOS, so corpora it preprocessed come out the same.
"""

from __future__ import annotations


class SentencePieceTokenizer:
    def __init__(self, model_file: str, add_bos: bool = False):
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as error:
            raise ValueError(
                f"--tokenizer-model {model_file}: not a SentencePiece model ({str(error).splitlines()[0]})"
            ) from None
        self.add_bos = add_bos
        self.vocab_size = self._sp.get_piece_size()
        self.bos = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos = self._sp.eos_id() if self._sp.eos_id() >= 0 else None
        if self.eos is None:
            raise ValueError(f"--tokenizer-model {model_file}: the model has no EOS piece to use as EOD")
        if add_bos and self.bos is None:
            raise ValueError(f"--tokenizer-model {model_file}: Llama2Tokenizer needs a BOS piece")
        self.eod = self.eos

    def tokenize(self, text: str) -> list[int]:
        ids = self._sp.encode_as_ids(text)
        return [self.bos] + ids if self.add_bos else ids

    def detokenize(self, ids) -> str:
        return self._sp.decode_ids([int(i) for i in ids])
