#!/usr/bin/env python
"""preprocess_data.py with 1 and 2 workers vs the same tokenizer's encoder in a plain loop.

    python tools/bench/preprocess.py [--copies 8] [--tokenizer gpt2|spm] [--rounds 3]

The input is the shipped corpus (data/corpus/stories.jsonl) repeated --copies times. The
plain loop is the floor of the work (json.loads + tokenize + append EOD, one process, no
output); preprocess_data.py adds worker processes, moving tokens between them and writing
.bin/.idx. Each configuration runs --rounds times in alternation; the table shows the
median docs/s and MB/s (processing time as preprocess_data.py reports it, tokenizer
loading and process start-up excluded) and the ratio to the plain loop. With 2 workers on
a machine with 2 free cores the ratio approaches 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from megatron.data.tokenizers import build_tokenizer  # noqa: E402

TOKENIZERS = {
    "gpt2": [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(ROOT / "data/tokenizers/gpt2-bpe/vocab.json"),
        "--merge-file",
        str(ROOT / "data/tokenizers/gpt2-bpe/merges.txt"),
    ],
    "spm": [
        "--tokenizer-type",
        "Llama2Tokenizer",
        "--tokenizer-model",
        str(ROOT / "data/tokenizers/spm/tokenizer.model"),
    ],
}
SUMMARY = re.compile(r"processed (\d+) documents \(([\d.]+) MB\) in ([\d.]+) s")


def plain_loop(path: str, flags: list[str]) -> tuple[float, int, int]:
    """(seconds, documents, bytes) of tokenizing every line in this process."""
    options = dict(zip([f[2:].replace("-", "_") for f in flags[0::2]], flags[1::2]))
    tokenizer = build_tokenizer(**options)
    lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    start = time.perf_counter()
    for line in lines:
        ids = tokenizer.tokenize(json.loads(line)["text"])
        ids.append(tokenizer.eod)
    return time.perf_counter() - start, len(lines), sum(len(line.encode("utf-8")) for line in lines)


def tool_run(path: str, flags: list[str], workers: int, out_dir: str) -> tuple[float, int, int]:
    cmd = [
        sys.executable,
        str(ROOT / "tools/preprocess_data.py"),
        "--input",
        path,
        "--output-prefix",
        os.path.join(out_dir, f"w{workers}"),
        "--append-eod",
        "--workers",
        str(workers),
        "--log-interval",
        "0",
        *flags,
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    docs, mb, seconds = SUMMARY.search(out).groups()
    return float(seconds), int(docs), int(float(mb) * 2**20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--tokenizer", choices=sorted(TOKENIZERS), default="gpt2")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    flags = TOKENIZERS[args.tokenizer]
    corpus = (ROOT / "data/corpus/stories.jsonl").read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "corpus.jsonl")
        Path(path).write_text(corpus * args.copies, encoding="utf-8")
        runs = {
            "plain loop (1 process)": lambda: plain_loop(path, flags),
            "preprocess_data --workers 1": lambda: tool_run(path, flags, 1, tmp),
            "preprocess_data --workers 2": lambda: tool_run(path, flags, 2, tmp),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                seconds, docs, size = run()
                times[name].append(seconds)
    base = statistics.median(times["plain loop (1 process)"])
    print(
        f"{args.tokenizer} tokenizer, {docs} documents, {size / 2**20:.2f} MB, {os.cpu_count()} CPUs, "
        f"median of {args.rounds} rounds"
    )
    print(f"{'run':<30} {'docs/s':>10} {'MB/s':>8} {'vs plain loop':>14}")
    for name, values in times.items():
        seconds = statistics.median(values)
        print(f"{name:<30} {docs / seconds:>10.0f} {size / seconds / 2**20:>8.2f} {base / seconds:>13.2f}x")


if __name__ == "__main__":
    main()
