"""Fixtures shared by the multi-process tests."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cli import GPT2_BPE, ROOT


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """The shipped corpus preprocessed with the shipped GPT-2 BPE tokenizer (EOD appended): a prefix."""
    out = tmp_path_factory.mktemp("corpus") / "stories"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "preprocess_data.py"),
            "--input",
            str(ROOT / "data" / "corpus" / "stories.jsonl"),
            "--output-prefix",
            str(out),
            "--append-eod",
            "--workers",
            "1",
        ]
        + GPT2_BPE,
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    return f"{out}_text_document"
