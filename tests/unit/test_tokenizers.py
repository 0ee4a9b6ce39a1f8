"""Our GPT-2 BPE encoder gives the `tokenizers` library's ids; every tokenizer type loads from local files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.data.tokenizers import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
VOCAB = str(ROOT / "data/tokenizers/gpt2-bpe/vocab.json")
MERGES = str(ROOT / "data/tokenizers/gpt2-bpe/merges.txt")
SPM = str(ROOT / "data/tokenizers/spm/tokenizer.model")
CORPUS = ROOT / "data/corpus/stories.jsonl"

TEXTS = [
    "Hello world",
    " leading space",
    "trailing space ",
    "runs   of  spaces\tand\ttabs\n\n\nnewlines \n ",
    "don't I'll we've she'd they're it's I'm Y'ALL'D",
    "'s's 're've",
    "digits 1234567890 3.14159 -42 1e10 ½ ٣",
    "café naïve Zoë Müller Łódź São Paulo",
    "καλημέρα κόσμε спасибо こんにちは 谢谢 مرحبا 안녕하세요",
    "emoji 🙂👍🏽🏳️‍🌈 🦊☕",
    "<|endoftext|>",
    "before<|endoftext|>after <|endoftext|> spaced",
    "mixed😀text123with!!!punct...?!",
    "",
    " ",
    "\u00a0non-breaking\u2003em space",
    "a\r\nb\rc",
    "\x00\x01 control \x7f bytes",
    "ZWJ a\u200db",
    "x" * 300,
]


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)


def test_gpt2_bpe_matches_tokenizers_library(gpt2):
    tokenizers = pytest.importorskip("tokenizers", reason="the `tokenizers` library (the BPE oracle) is not installed")
    reference = tokenizers.ByteLevelBPETokenizer.from_file(VOCAB, MERGES)
    corpus = [json.loads(line)["text"] for line in CORPUS.open(encoding="utf-8")][:150]
    for text in TEXTS + corpus:
        assert gpt2.tokenize(text) == reference.encode(text).ids, repr(text[:60])


def test_gpt2_bpe_round_trips_and_defines_eod(gpt2):
    assert gpt2.vocab_size == len(json.load(open(VOCAB)))
    assert gpt2.eod == json.load(open(VOCAB))["<|endoftext|>"]
    for text in TEXTS:
        assert gpt2.detokenize(gpt2.tokenize(text)) == text
    assert gpt2.tokenize("a") == gpt2.tokenize("a")  # served from the cache


def test_sentencepiece_types():
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=SPM)
    plain = build_tokenizer("SentencePieceTokenizer", tokenizer_model=SPM)
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=SPM)
    text = "Zoë paid 12.50 crowns 🙂"
    assert plain.vocab_size == llama.vocab_size == sp.get_piece_size()
    assert (plain.bos, plain.eos, plain.eod) == (sp.bos_id(), sp.eos_id(), sp.eos_id())
    assert plain.tokenize(text) == sp.encode_as_ids(text)
    assert llama.tokenize(text) == [sp.bos_id()] + sp.encode_as_ids(text)
    assert plain.detokenize(plain.tokenize(text)) == text


def test_huggingface_tokenizer_from_local_directory(tmp_path, gpt2):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    backend = tokenizers.ByteLevelBPETokenizer.from_file(VOCAB, MERGES)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend._tokenizer, eos_token="<|endoftext|>")
    hf.save_pretrained(tmp_path)
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert tok.vocab_size == gpt2.vocab_size and tok.eod == gpt2.eod
    assert tok.tokenize("Hello there, Zoë") == gpt2.tokenize("Hello there, Zoë")
    assert tok.detokenize(tok.tokenize("Hello there")) == "Hello there"


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.vocab_size == 101 and tok.eod == 100  # Megatron-LM's: V ordinary ids, then EOD = V
    assert tok.tokenize("3 1 4") == [3, 1, 4] and tok.detokenize([3, 1, 4]) == "3 1 4"


BAD = [
    (
        dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/x/vocab.json", merge_file=MERGES),
        "--vocab-file /x/vocab.json: no such file",
    ),
    (
        dict(tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB, merge_file="/x/merges.txt"),
        "--merge-file /x/merges.txt: no such file",
    ),
    (
        dict(tokenizer_type="GPT2BPETokenizer", merge_file=MERGES),
        "--tokenizer-type GPT2BPETokenizer needs --vocab-file",
    ),
    (
        dict(tokenizer_type="Llama2Tokenizer", tokenizer_model="/x/t.model"),
        "--tokenizer-model /x/t.model: no such file",
    ),
    (dict(tokenizer_type="Llama2Tokenizer"), "needs --tokenizer-model"),
    (dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=VOCAB), "not a SentencePiece model"),
    (
        dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/x/dir"),
        "--tokenizer-model /x/dir: no such directory",
    ),
    (dict(tokenizer_type="NullTokenizer"), "NullTokenizer needs --vocab-size"),
    (dict(tokenizer_type="BertWordPieceCase"), "--tokenizer-type 'BertWordPieceCase': choose one of"),
    (dict(tokenizer_type=None), "--tokenizer-type is required"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file=MERGES, merge_file=MERGES), "not a JSON vocabulary"),
]


@pytest.mark.parametrize("kwargs, message", BAD, ids=[m for _, m in BAD])
def test_bad_tokenizer_flags_fail_in_one_line(kwargs, message):
    with pytest.raises(ValueError) as info:
        build_tokenizer(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)
