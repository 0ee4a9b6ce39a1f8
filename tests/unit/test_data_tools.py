"""preprocess_data.py round-trips, reports bad lines as file:line; inspect_data.py shows the trainer's samples;
the data flags validate in one line."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import pytest

from megatron.data.builder import build_datasets
from megatron.data.indexed_dataset import IndexedDataset
from megatron.data.tokenizers import build_tokenizer
from megatron.training.arguments.data import add_data_arguments, data_config_from_args
from tests.cli import load_tool

ROOT = Path(__file__).resolve().parents[2]
SPM = str(ROOT / "data/tokenizers/spm/tokenizer.model")
CORPUS = ROOT / "data/corpus/stories.jsonl"


@pytest.fixture(scope="module")
def preprocess():
    return load_tool("preprocess_data")


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def spm_args(input_path, prefix, *extra):
    return [
        "--input",
        input_path,
        "--output-prefix",
        str(prefix),
        "--tokenizer-type",
        "Llama2Tokenizer",
        "--tokenizer-model",
        SPM,
        "--log-interval",
        "0",
        *extra,
    ]


def test_preprocess_round_trips(preprocess, tmp_path):
    docs = [
        {"text": "Zoë's 12 kettles 🙂", "title": "One"},
        {"text": "", "title": "Empty"},
        {"text": "tabs\tand\n\nnewlines", "title": "Three"},
    ]
    source = write_jsonl(tmp_path / "in.jsonl", [json.dumps(d, ensure_ascii=False) for d in docs])
    stats = preprocess.main(
        spm_args(source, tmp_path / "out", "--json-keys", "text", "title", "--append-eod", "--workers", "2")
    )
    assert stats["documents"] == 3
    tok = build_tokenizer("Llama2Tokenizer", tokenizer_model=SPM)
    for key in ("text", "title"):
        ds = IndexedDataset(str(tmp_path / f"out_{key}_document"))
        expected = [tok.tokenize(d[key]) + [tok.eod] for d in docs]
        assert ds.dtype == np.uint16 and len(ds.document_indices) == 4
        assert [ds[i].tolist() for i in range(len(ds))] == [e for e in expected]  # Llama2 adds BOS even to ""
        assert tok.detokenize(ds[0].tolist()[1:-1]) == docs[0][key]


def test_workers_and_partitions_give_megatron_order(preprocess, tmp_path):
    lines = [json.dumps({"text": f"document number {i} " * (i % 7 + 1)}) for i in range(41)]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    preprocess.main(spm_args(source, tmp_path / "one", "--workers", "1"))
    preprocess.main(spm_args(source, tmp_path / "two", "--workers", "2"))
    preprocess.main(spm_args(source, tmp_path / "parts", "--workers", "2", "--partitions", "2"))
    one, two, parts = (IndexedDataset(str(tmp_path / f"{n}_text_document")) for n in ("one", "two", "parts"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one_text_document{suffix}").read_bytes() == (
            tmp_path / f"two_text_document{suffix}"
        ).read_bytes()
    round_robin = list(range(0, 41, 2)) + list(range(1, 41, 2))  # lines dealt to partitions, then merged
    assert [parts[i].tolist() for i in range(41)] == [one[j].tolist() for j in round_robin]
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["in.jsonl"] + [f"{n}_text_document{s}" for n in ("one", "two", "parts") for s in (".bin", ".idx")]
    )


BAD_LINES = [
    ('{"text": "fine"', "not valid JSON"),
    ('["a list"]', "expected a JSON object, got list"),
    ('{"body": "no text key"}', "key 'text' is missing"),
    ('{"text": 42}', "key 'text' is int, not a string"),
]


@pytest.mark.parametrize("line, message", BAD_LINES, ids=[m for _, m in BAD_LINES])
def test_bad_line_names_file_and_line(preprocess, tmp_path, line, message, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", ['{"text": "one"}', '{"text": "two"}', line, '{"text": "four"}'])
    with pytest.raises(SystemExit) as info:
        preprocess.main(spm_args(source, tmp_path / "out", "--workers", "1"))
    assert info.value.code == 2 and capsys.readouterr().err.startswith(f"error: {source}:3: {message}")
    assert os.listdir(tmp_path) == ["in.jsonl"]  # nothing half-written is left
    stats = preprocess.main(spm_args(source, tmp_path / "out", "--workers", "2", "--skip-bad-lines"))
    assert (stats["documents"], stats["skipped"]) == (3, 1)
    assert "skipped 1 bad lines" in capsys.readouterr().out


def test_bad_line_in_a_partition(preprocess, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", ['{"text": "a"}', '{"text": "b"}', '{"text": "c"}', "oops"])
    with pytest.raises(SystemExit):
        preprocess.main(spm_args(source, tmp_path / "out", "--workers", "2", "--partitions", "2"))
    assert f"{source}:4: not valid JSON" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_preprocess_refuses_bad_flags(preprocess, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", ['{"text": "a"}'])
    for extra, message in [
        (["--workers", "3", "--partitions", "2"], "--workers (3) must be a multiple of --partitions"),
        (["--workers", "1", "--split-sentences"], "--split-sentences: sentence splitting"),
    ]:
        with pytest.raises(SystemExit):
            preprocess.main(spm_args(source, tmp_path / "out", *extra))
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        preprocess.main(
            [
                "--input",
                source,
                "--output-prefix",
                str(tmp_path / "o"),
                "--tokenizer-type",
                "Llama2Tokenizer",
                "--tokenizer-model",
                "/no/t.model",
                "--workers",
                "1",
            ]
        )
    assert "--tokenizer-model /no/t.model: no such file" in capsys.readouterr().err


def test_inspect_prints_the_trainers_samples(preprocess, tmp_path, capsys):
    preprocess.main(
        [
            "--input",
            str(CORPUS),
            "--output-prefix",
            str(tmp_path / "c"),
            "--tokenizer-type",
            "Llama2Tokenizer",
            "--tokenizer-model",
            SPM,
            "--append-eod",
            "--workers",
            "2",
            "--log-interval",
            "0",
        ]
    )
    prefix = str(tmp_path / "c_text_document")
    capsys.readouterr()
    inspect = load_tool("inspect_data")
    common = [
        "--data-path",
        "1",
        prefix,
        "--seq-length",
        "16",
        "--seed",
        "9",
        "--split",
        "98,2,0",
        "--tokenizer-type",
        "Llama2Tokenizer",
        "--tokenizer-model",
        SPM,
    ]
    inspect.main(common + ["--train-iters", "10", "--global-batch-size", "8", "--samples", "3:6", "--json"])
    rows = json.loads(capsys.readouterr().out)
    args = argparse.Namespace(
        data_path=["1", prefix],
        split="98,2,0",
        train_data_path=None,
        valid_data_path=None,
        test_data_path=None,
        data_cache_path=None,
        tokenizer_type="Llama2Tokenizer",
        vocab_file=None,
        merge_file=None,
        tokenizer_model=SPM,
        eod_mask_loss=False,
        reset_position_ids=False,
        reset_attention_mask=False,
        num_workers=2,
    )
    config = data_config_from_args(args)
    train = build_datasets(config, build_tokenizer(**config.tokenizer_args()), 16, 9, 80, 0, 0)[0]
    assert rows == [train[i]["tokens"].tolist() + train[i]["labels"].tolist()[-1:] for i in range(3, 6)]
    inspect.main(common + ["--train-samples", "80", "--samples", "3:4"])
    out = capsys.readouterr().out
    assert out.startswith("sample 3: " + " ".join(map(str, rows[0]))) and "\ntext 3: " in out


def parse(argv):
    parser = argparse.ArgumentParser()
    add_data_arguments(parser)
    return data_config_from_args(parser.parse_args(argv))


def test_data_flags(tmp_path):
    prefix = str(tmp_path / "d")
    for suffix in (".bin", ".idx"):
        open(prefix + suffix, "wb").close()
    config = parse(
        [
            "--data-path",
            "0.3",
            prefix,
            "0.7",
            prefix,
            "--tokenizer-type",
            "NullTokenizer",
            "--eod-mask-loss",
            "--data-cache-path",
            "/tmp/c",
        ]
    )
    assert config.blend.weights == [0.3, 0.7] and config.split_bounds[0] == (0.0, 0.969) and config.eod_mask_loss
    assert parse(["--data-path", prefix, prefix]).blend.weights is None
    per_split = parse(["--train-data-path", prefix, "--test-data-path", prefix])
    assert per_split.blend is None and per_split.blend_per_split[1] is None
    assert parse(["--data-path", prefix, "--split", "100,0,0"]).split_bounds[1:] == [None, None]
    errors = [
        (["--data-path", str(tmp_path / "foo")], f"--data-path {tmp_path}/foo: {tmp_path}/foo.bin not found"),
        (["--data-path", prefix, "--train-data-path", prefix], "give either --data-path or --train-data-path"),
        ([], "no data: pass --data-path"),
        (["--valid-data-path", prefix], "--valid-data-path/--test-data-path need --train-data-path"),
        (["--data-path", "0", prefix], "--data-path: weights must be > 0"),
        (["--data-path", prefix, "--num-workers", "-1"], "--num-workers must be >= 0"),
    ]
    for argv, message in errors:
        with pytest.raises(ValueError) as info:
            parse(argv)
        assert message in str(info.value), argv
