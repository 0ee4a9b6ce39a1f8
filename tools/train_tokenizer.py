"""Train the two shipped tokenizers from a jsonl corpus (default: the shipped data/corpus/stories.jsonl).

    python tools/train_tokenizer.py [--input data/corpus/stories.jsonl] [--output-dir data/tokenizers]

writes
    <output-dir>/gpt2-bpe/vocab.json, merges.txt   GPT-2 style byte-level BPE (GPT2BPETokenizer),
                                                   <|endoftext|> = id 0; trained with the
                                                   `tokenizers` library (our encoder does not use it)
    <output-dir>/spm/tokenizer.model                SentencePiece BPE laid out like Llama's
                                                   (unk 0, <s> 1, </s> 2, byte fallback, split digits)
Both trainers run single-threaded so the same corpus gives the same files.
"""

from __future__ import annotations

import argparse
import io
import json
import os


def read_texts(path: str, key: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)[key] for line in f if line.strip()]


def train_gpt2_bpe(texts: list[str], vocab_size: int, out_dir: str) -> None:
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False
    )
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_model(out_dir)


def train_sentencepiece(texts: list[str], vocab_size: int, out_dir: str) -> None:
    import sentencepiece

    lines = [line for text in texts for line in text.split("\n") if line.strip()]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        num_threads=1,
        minloglevel=2,
    )
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.model"), "wb") as f:
        f.write(model.getvalue())


def main(argv: list[str] | None = None) -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", default=os.path.join(root, "data", "corpus", "stories.jsonl"))
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--output-dir", default=os.path.join(root, "data", "tokenizers"))
    parser.add_argument("--bpe-vocab-size", type=int, default=2048)
    parser.add_argument("--spm-vocab-size", type=int, default=1024)
    args = parser.parse_args(argv)
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input}: no such file")
    texts = read_texts(args.input, args.json_key)
    train_gpt2_bpe(texts, args.bpe_vocab_size, os.path.join(args.output_dir, "gpt2-bpe"))
    train_sentencepiece(texts, args.spm_vocab_size, os.path.join(args.output_dir, "spm"))
    print(
        f"wrote {args.output_dir}/gpt2-bpe/{{vocab.json,merges.txt}} and {args.output_dir}/spm/tokenizer.model "
        f"from {len(texts)} documents"
    )


if __name__ == "__main__":
    main()
