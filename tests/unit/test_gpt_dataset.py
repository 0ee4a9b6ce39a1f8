"""GPTDataset and BlendedDataset: megatron-core's sample order, no token lost or repeated, caching, bad input."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.data import blending_loop
from megatron.data.blended_dataset import (
    build_blending_indices,
    build_exhaustive_blending_indices,
    normalize,
    python_blending_indices,
    python_exhaustive_blending_indices,
)
from megatron.data.builder import build_datasets
from megatron.data.config import Blend, DataConfig
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.gpt_indices import build_sample_index, plan_epochs
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megatron.data.tokenizers import build_tokenizer
from tests.cli import load_tool

ROOT = Path(__file__).resolve().parents[2]
VOCAB, MERGES = str(ROOT / "data/tokenizers/gpt2-bpe/vocab.json"), str(ROOT / "data/tokenizers/gpt2-bpe/merges.txt")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The shipped corpus preprocessed twice: A in file order, B dealt to 2 partitions (another order)."""
    out = tmp_path_factory.mktemp("corpus")
    preprocess = load_tool("preprocess_data")
    common = [
        "--input",
        str(ROOT / "data/corpus/stories.jsonl"),
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        VOCAB,
        "--merge-file",
        MERGES,
        "--append-eod",
        "--log-interval",
        "0",
    ]
    preprocess.main(common + ["--output-prefix", str(out / "a"), "--workers", "1"])
    preprocess.main(common + ["--output-prefix", str(out / "b"), "--workers", "2", "--partitions", "2"])
    return str(out / "a_text_document"), str(out / "b_text_document")


def digest(dataset, count=1000) -> str:
    rows = [dataset.sample_tokens(i).tolist() for i in range(min(count, len(dataset)))]
    return hashlib.md5(json.dumps(rows).encode()).hexdigest()


# Lengths and md5 of the first 1000 samples (seq_length + 1 ids each) that megatron-core 0.16.1's
# BlendedMegatronDatasetBuilder + GPTDataset produced from the same two files (run in a separate
# environment, since megatron-core installs as `megatron`).
MEGATRON_CORE = [
    (
        dict(blend=["A"], split="90,8,2"),
        [5000, 100, 20],
        32,
        1234,
        {0: (6641, "a3769b842da8cd5196614b44118e4181"), 1: (304, "a9d6a6b83e78a47c99d1b4f4ab5c5fed")},
    ),
    (dict(blend=["A"], split="90,8,2"), [10500, 3, 2], 32, 7, {0: (13282, "9996bcee6f65f5f2617bef07444439be")}),
    (
        dict(blend=["0.3", "A", "0.7", "B"], split="90,8,2"),
        [3000, 200, 20],
        32,
        1234,
        {0: (3000, "0f8a82f90e7562c261423574c3c168bc"), 1: (200, "49267f914864407241d053b2b590609e")},
    ),
    (dict(blend=["A", "B"], split="90,8,2"), [3000, 200, 20], 32, 99, {0: (3000, "4b4e934120193216c87f77d564e256a5")}),
    (
        dict(per_split=[["0.5", "A", "0.5", "B"], ["B"], ["1", "A", "2", "B"]]),
        [2000, 100, 50],
        16,
        3,
        {0: (2000, "e4d2f0718c65d3c75b576dfd18f8a4ac"), 1: (7336, "6e074ea98343dc59bf4051bc81abf92e")},
    ),
]


@pytest.mark.parametrize(
    "flags, sizes, seq, seed, expected",
    MEGATRON_CORE,
    ids=["separate-final-epoch", "four-epochs", "weighted", "bare-list", "per-split"],
)
def test_samples_match_megatron_core(corpus, tokenizer, tmp_path, flags, sizes, seq, seed, expected):
    names = dict(zip("AB", corpus))
    if "blend" in flags:
        config = DataConfig(
            blend=Blend.parse([names.get(x, x) for x in flags["blend"]]), split=flags["split"], cache_path=str(tmp_path)
        )
    else:
        config = DataConfig(
            blend_per_split=[Blend.parse([names.get(x, x) for x in b]) for b in flags["per_split"]],
            cache_path=str(tmp_path),
        )
    datasets = build_datasets(config, tokenizer, seq, seed, *sizes)
    for split, (length, md5) in expected.items():
        assert (len(datasets[split]), digest(datasets[split])) == (length, md5)


def sequential_sample_index(lengths, document_index, seq_length, num_samples):
    """megatron-core's C++ walk over the document stream, transcribed as a plain loop."""
    rows, doc, offset = [(0, 0)], 0, 0
    while len(rows) <= num_samples:
        remaining = seq_length + 1
        while remaining:
            length = lengths[document_index[doc]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                doc, offset = doc + 1, 0
        rows.append((doc, offset))
    return rows


def test_sample_index_matches_sequential_walk():
    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = rng.integers(0, 40, size=rng.integers(1, 30)).astype(np.int32)
        lengths[rng.integers(len(lengths))] += 1
        seq, epochs = int(rng.integers(2, 20)), int(rng.integers(1, 4))
        document_index = np.tile(np.arange(len(lengths), dtype=np.int32), epochs)
        rng.shuffle(document_index)
        tokens = int(lengths.sum())
        if epochs * tokens <= seq:
            continue
        ours = build_sample_index(lengths, document_index, seq, epochs, tokens)
        expected = sequential_sample_index(lengths, document_index, seq, (epochs * tokens - 1) // seq)
        assert ours.tolist() == [list(r) for r in expected]


def make_dataset(tmp_path, docs, **kwargs):
    prefix = str(tmp_path / "docs")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for doc in docs:
            writer.add_document(doc)
    options = dict(split_name="train", seq_length=8, seed=1, eod=0, cache_dir=None)
    options.update(kwargs)
    num_samples = options.pop("num_samples", None)
    indexed = IndexedDataset(prefix)
    return GPTDataset(indexed, np.arange(len(indexed)), num_samples, **options)


def random_docs(seed=0, count=40):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(1, 500, size=rng.integers(1, 30))) + [0] for _ in range(count)]


def test_one_epoch_covers_every_token_once_with_shared_boundaries(tmp_path):
    docs = random_docs()
    ds = make_dataset(tmp_path, docs)
    stream = np.concatenate([docs[d] for d in ds.document_index])
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))
    by_row = {int(row): ds.sample_tokens(i) for i, row in enumerate(ds.shuffle_index)}
    for row in range(len(ds)):
        assert by_row[row].tolist() == stream[row * 8 : row * 8 + 9].tolist()
        if row + 1 < len(ds):
            assert by_row[row][-1] == by_row[row + 1][0]
    assert len(ds) == (len(stream) - 1) // 8  # only the partial tail is dropped
    assert sorted(ds.document_index.tolist()) == list(range(len(docs)))


def test_shuffles_depend_only_on_the_seed(tmp_path):
    docs = random_docs()
    a = make_dataset(tmp_path, docs, num_samples=300, seed=5)
    b = make_dataset(tmp_path, docs, num_samples=300, seed=5, cache_dir=str(tmp_path / "cache"))
    c = make_dataset(tmp_path, docs, num_samples=300, seed=6)
    assert [a.sample_tokens(i).tolist() for i in range(len(a))] == [b.sample_tokens(i).tolist() for i in range(len(b))]
    assert a.document_index.tolist() != c.document_index.tolist()
    assert a.shuffle_index.tolist() != c.shuffle_index.tolist()


def test_every_field_that_orders_the_samples_keys_the_cache(tmp_path):
    """A cached index is reused only for the same seed, sample count, sequence length, documents
    and file: changing any of them builds (and caches) its own indices, never the stale ones."""
    cache = tmp_path / "cache"
    indexed_prefix = tmp_path / "docs"
    make_dataset(tmp_path, random_docs(), num_samples=300, seed=5, cache_dir=str(cache))
    indexed = IndexedDataset(str(indexed_prefix))
    base = dict(split_name="train", seq_length=8, seed=5, eod=0)
    variants = {
        "seed": dict(seed=6),
        "seq_length": dict(seq_length=7),
        "num_samples": dict(num_samples=200),
        "documents": dict(documents=np.arange(1, len(indexed))),
    }
    for field, change in variants.items():
        options = {**base, "num_samples": 300, "documents": np.arange(len(indexed)), **change}
        documents, num_samples = options.pop("documents"), options.pop("num_samples")
        files = set(cache.iterdir())
        cached = GPTDataset(indexed, documents, num_samples, cache_dir=str(cache), **options)
        fresh = GPTDataset(indexed, documents, num_samples, cache_dir=None, **options)
        assert set(cache.iterdir()) != files, f"{field}: no cache of its own"
        for name in ("document_index", "sample_index", "shuffle_index"):
            assert getattr(cached, name).tolist() == getattr(fresh, name).tolist(), (field, name)
    files = set(cache.iterdir())
    other = make_dataset(tmp_path, random_docs(seed=1), num_samples=300, seed=5, cache_dir=str(cache))
    assert set(cache.iterdir()) != files, "another file at the same path: no cache of its own"
    fresh = make_dataset(tmp_path, random_docs(seed=1), num_samples=300, seed=5)
    assert other.shuffle_index.tolist() == fresh.shuffle_index.tolist()


def test_final_epoch_is_shuffled_apart_when_mostly_unused():
    plan = plan_epochs(tokens_per_epoch=1001, seq_length=10, num_samples=120)  # 100 per epoch, 20 from the 2nd
    assert (plan.num_epochs, plan.separate_final_epoch, plan.samples_before_final_epoch) == (2, True, 100)
    assert not plan_epochs(1001, 10, 190).separate_final_epoch  # 90 of the 2nd epoch's 100: one shuffle
    assert plan_epochs(1001, 10, None).num_epochs == 1


def test_item_masks_and_positions_follow_megatron(tmp_path):
    docs = [[3, 4, 0], [5, 0], [6, 7, 8, 9, 10, 11, 0]]
    ds = make_dataset(tmp_path, docs, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    for i in range(len(ds)):
        item = ds[i]
        text = torch.from_numpy(ds.sample_tokens(i))
        assert item["tokens"].tolist() == text[:-1].tolist() and item["labels"].tolist() == text[1:].tolist()
        assert item["tokens"].dtype == item["labels"].dtype == item["position_ids"].dtype == torch.int64
        # Megatron's loop: loss 0 on EOD inputs; after the EOD at i positions restart and
        # later tokens stop attending to [0, i]
        tokens, s = item["tokens"], 8
        loss_mask, positions = torch.ones(s), torch.arange(s)
        mask = torch.tril(torch.ones(s, s))
        loss_mask[tokens == 0] = 0
        prev = 0
        for j in (tokens == 0).nonzero().flatten().tolist():
            mask[j + 1 :, : j + 1] = 0
            positions[j + 1 :] -= j + 1 - prev
            prev = j + 1
        assert item["loss_mask"].tolist() == loss_mask.tolist()
        assert item["position_ids"].tolist() == positions.tolist()
        ids = item["document_ids"]
        assert ((ids[:, None] == ids[None, :]) & torch.tril(torch.ones(s, s, dtype=torch.bool))).float().equal(mask)
    plain = make_dataset(tmp_path, docs)[0]
    assert sorted(plain) == ["labels", "loss_mask", "position_ids", "tokens"]
    assert plain["loss_mask"].tolist() == [1.0] * 8 and plain["position_ids"].tolist() == list(range(8))


def test_blending_stays_within_one_sample_of_the_weights():
    rng = np.random.default_rng(1)
    for _ in range(10):
        weights = normalize(rng.random(int(rng.integers(2, 5))) + 0.05)
        index, sample = build_blending_indices(weights, 2000)
        counts = np.cumsum(np.eye(len(weights))[index], axis=0)
        targets = np.arange(1, 2001)[:, None] * np.array(weights)[None]
        assert np.abs(counts - targets).max() < 2
        assert np.abs(counts[-1] - targets[-1]).max() <= 1
        for d in range(len(weights)):  # each dataset's samples are taken in order, once
            assert sample[index == d].tolist() == list(range(int((index == d).sum())))
    assert build_blending_indices([0.5, 0.5], 4)[0].tolist() == [0, 1, 0, 1]  # ties go to the lower index
    index, sample = build_exhaustive_blending_indices([3, 1])
    assert index.tolist() == [0, 1, 0, 0] and sample.tolist() == [0, 0, 1, 2]


def test_compiled_blending_loop_gives_the_python_loop_indices():
    """The loop that builds the indices (compiled) equals the Python definition on random weights
    and sizes, exact ties and datasets that run out."""
    assert blending_loop.native() is not None, "no C compiler: the blending indices are built in Python"
    rng = np.random.default_rng(7)
    cases = [[0.5, 0.5], normalize([1, 1, 1]), normalize([1, 2, 4, 8, 16])]
    cases += [normalize(rng.random(int(rng.integers(2, 12))) ** 3 + 1e-3) for _ in range(20)]
    for weights in cases:
        size = int(rng.integers(1, 3000))
        ours, reference = build_blending_indices(weights, size), python_blending_indices(weights, size)
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(ours, reference)), weights
    for _ in range(20):
        sizes = rng.integers(0, 300, size=int(rng.integers(1, 8))).tolist() + [1]
        ours, reference = build_exhaustive_blending_indices(sizes), python_exhaustive_blending_indices(sizes)
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(ours, reference)), sizes


def test_builder_builds_once_and_others_load_the_cache(corpus, tokenizer, tmp_path):
    config = DataConfig(
        blend=Blend.parse(["0.5", corpus[0], "0.5", corpus[1]]), split="90,8,2", cache_path=str(tmp_path)
    )
    events = []
    with pytest.raises(ValueError, match="dataset index cache is missing after the builder rank ran"):
        build_datasets(config, tokenizer, 16, 1, 100, 10, 10, is_builder=False, barrier=lambda: events.append("b"))
    built = build_datasets(config, tokenizer, 16, 1, 100, 10, 10, is_builder=True, barrier=lambda: events.append("b"))
    files = sorted(p.name for p in tmp_path.iterdir())
    loaded = build_datasets(config, tokenizer, 16, 1, 100, 10, 10, is_builder=False, barrier=lambda: events.append("b"))
    assert events == ["b", "b", "b"] and sorted(p.name for p in tmp_path.iterdir()) == files
    assert not any(".tmp" in name for name in files)
    assert isinstance(loaded[0].dataset_index, np.memmap)
    for a, b in zip(built, loaded):
        assert digest(a, 50) == digest(b, 50)
    item = built[0][0]
    assert item["dataset_id"] in (0, 1) and item["tokens"].shape == (16,)


def test_bad_data_fails_in_one_line(corpus, tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"--data-path /no/foo: /no/foo.bin not found"):
        DataConfig(blend=Blend.parse(["/no/foo"]))
    with pytest.raises(ValueError, match=r"--valid-data-path /no/v: /no/v.bin not found"):
        DataConfig(blend_per_split=[Blend.parse([corpus[0]]), Blend.parse(["/no/v"]), None])
    small = build_tokenizer("NullTokenizer", vocab_size=100)
    config = DataConfig(blend=Blend.parse([corpus[0]]), split="90,8,2", cache_path=str(tmp_path))
    train = build_datasets(config, small, 16, 1, 10, 1, 1)[0]  # start-up reads no token of the .bin...
    with pytest.raises(
        ValueError,
        match=r"a_text_document.bin: token id \d+ \(in train sample 0\) is outside the "
        r"tokenizer's vocabulary of 101 ids",
    ):
        train[0]  # ...each sample is checked as it is read
    tiny = make_dataset(tmp_path, [[1, 2, 0]] * 3)
    with pytest.raises(ValueError, match="the valid split holds no tokens"):
        GPTDataset(tiny.indexed, np.arange(0), 5, split_name="valid", seq_length=8, seed=1, eod=0)
    with pytest.raises(ValueError, match=r"--split 'x': expected up to three"):
        DataConfig(blend=Blend.parse([corpus[0]]), split="x")
