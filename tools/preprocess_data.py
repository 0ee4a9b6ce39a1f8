"""Tokenize a jsonl corpus into Megatron's indexed format, with Megatron-LM's flags.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix out/my \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2

writes out/my_<key>_document.bin/.idx for each --json-keys key (one document per line).
Each worker process reads a line-aligned byte range of the input itself, parses and
tokenizes its lines and sends back their tokens packed as bytes of the output dtype, so
the parent only writes and the work scales with --workers. With --partitions P, lines are dealt
round-robin to P partitions processed side by side (workers / P processes each) and merged
in partition order, as Megatron-LM does. Outputs appear only when complete (temporary
names, renamed at the end). A malformed line stops the run with `file:line: what is
wrong`, or is counted and skipped with --skip-bad-lines.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from megatron.data.indexed_dataset import IndexedDatasetWriter, token_dtype  # noqa: E402
from megatron.data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from megatron.training.arguments.errors import EXPECTED_ERRORS, report_error  # noqa: E402

CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 1 << 14


class BadLine(ValueError):
    """A jsonl line that cannot be used; its message is `file:line: reason`."""


class Encoder:
    """Lives in each worker process: reads a byte range of the input and tokenizes its lines."""

    tokenizer = None

    def __init__(self, args, partition: int = 0, partitions: int = 1):
        self.args, self.partition, self.partitions = args, partition, partitions

    def load(self) -> None:
        Encoder.tokenizer = build_tokenizer(**tokenizer_kwargs(self.args))
        Encoder.dtype = token_dtype(Encoder.tokenizer.vocab_size)

    def initializer(self) -> None:
        """In a worker: load the tokenizer unless forked from the parent that loaded it already."""
        if Encoder.tokenizer is None:
            self.load()

    def encode_line(self, line: bytes):
        """{key: token ids} of one jsonl line, or the reason it cannot be used (a str)."""
        try:
            data = json.loads(line)
        except json.JSONDecodeError as error:
            return f"not valid JSON ({error.msg} at column {error.colno})"
        except UnicodeDecodeError as error:
            return f"not UTF-8 ({error.reason} at byte {error.start})"
        if not isinstance(data, dict):
            return f"expected a JSON object, got {type(data).__name__}"
        encoded = {}
        for key in self.args.json_keys:
            text = data.get(key)
            if not isinstance(text, str):
                return f"key {key!r} is " + ("missing" if key not in data else f"{type(text).__name__}, not a string")
            ids = Encoder.tokenizer.tokenize(text)
            if ids and self.args.append_eod:
                ids.append(Encoder.tokenizer.eod)
            encoded[key] = ids
        return encoded

    def encode_chunk(self, chunk: tuple[int, int, int]) -> dict:
        """Lines of input bytes [begin, end) (line numbers from `first_line`) that belong to this
        partition: per key their tokens as bytes of the output dtype and per-document lengths,
        plus counts and the bad lines as (line number, reason)."""
        begin, end, first_line = chunk
        with open(self.args.input, "rb") as f:
            f.seek(begin)
            lines = f.read(end - begin).split(b"\n")
        tokens = {key: [] for key in self.args.json_keys}
        result = {"lengths": {key: [] for key in self.args.json_keys}, "documents": 0, "bytes": 0, "bad": []}
        for number, line in enumerate(lines, first_line):
            if (number - 1) % self.partitions != self.partition or not line.strip():
                continue
            encoded = self.encode_line(line)
            if isinstance(encoded, str):
                result["bad"].append((number, encoded))
                continue
            for key, ids in encoded.items():
                tokens[key].extend(ids)
                result["lengths"][key].append(len(ids))
            result["documents"] += 1
            result["bytes"] += len(line) + 1
        result["data"] = {key: np.asarray(ids, dtype=Encoder.dtype).tobytes() for key, ids in tokens.items()}
        return result


def tokenizer_kwargs(args) -> dict:
    return dict(
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
    )


def output_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


def chunks(path: str, workers: int) -> list[tuple[int, int, int]]:
    """(begin, end, first line number) of line-aligned byte ranges, a few per worker, at most CHUNK_BYTES."""
    size = os.path.getsize(path)
    target = max(MIN_CHUNK_BYTES, min(CHUNK_BYTES, size // (4 * workers) + 1))
    ranges, begin, line = [], 0, 1
    with open(path, "rb") as f:
        while begin < size:
            f.seek(min(begin + target, size))
            f.readline()
            end = min(f.tell(), size)
            f.seek(begin)
            ranges.append((begin, end, line))
            line += f.read(end - begin).count(b"\n")
            begin = end
    return ranges


def process(
    args, prefix: str, partition: int = 0, partitions: int = 1, workers: int | None = None, position: int = 0
) -> dict:
    """Tokenize this partition's lines into `<prefix>_<key>_document`; returns counts."""
    workers = workers or args.workers
    encoder = Encoder(args, partition, partitions)
    encoder.load()
    writers = {key: IndexedDatasetWriter(output_prefix(prefix, key), Encoder.dtype) for key in args.json_keys}
    stats = {"documents": 0, "bytes": 0, "skipped": 0, "seconds": 0.0}
    start = time.perf_counter()
    try:
        with (
            multiprocessing.Pool(workers, initializer=encoder.initializer) as pool,
            tqdm(
                unit=" docs",
                position=position,
                mininterval=1.0,
                disable=args.log_interval <= 0,
                desc=f"partition {partition}" if partitions > 1 else None,
            ) as bar,
        ):
            for result in pool.imap(encoder.encode_chunk, chunks(args.input, workers)):
                if result["bad"] and not args.skip_bad_lines:
                    number, reason = result["bad"][0]
                    raise BadLine(f"{args.input}:{number}: {reason} (pass --skip-bad-lines to skip such lines)")
                for key, writer in writers.items():
                    writer.add_documents_bytes(result["data"][key], result["lengths"][key])
                stats["skipped"] += len(result["bad"])
                stats["documents"] += result["documents"]
                stats["bytes"] += result["bytes"]
                if stats["documents"] - bar.n >= args.log_interval > 0:
                    bar.update(stats["documents"] - bar.n)
                    bar.set_postfix_str(f"{stats['bytes'] / (time.perf_counter() - start) / 2**20:.2f} MB/s")
            bar.update(stats["documents"] - bar.n)
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    for writer in writers.values():
        writer.finalize()
    stats["seconds"] = time.perf_counter() - start
    return stats


def _partition_main(args, partition: int, queue) -> None:
    try:
        stats = process(
            args,
            f"{args.output_prefix}_{partition}",
            partition,
            args.partitions,
            args.workers // args.partitions,
            position=partition,
        )
        queue.put((partition, stats, None))
    except BaseException as error:  # reported by the parent as one line
        queue.put((partition, None, str(error)))


def process_partitions(args) -> dict:
    """Run the partitions side by side, then merge their outputs in partition order."""
    queue = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=_partition_main, args=(args, p, queue)) for p in range(args.partitions)]
    for proc in procs:
        proc.start()
    results = [queue.get() for _ in procs]
    for proc in procs:
        proc.join()
    parts = [f"{args.output_prefix}_{p}" for p in range(args.partitions)]
    try:
        errors = [message for _, _, message in sorted(results, key=lambda r: r[0]) if message]
        if errors:
            raise BadLine(errors[0])
        total = {"documents": 0, "bytes": 0, "skipped": 0, "seconds": max(s["seconds"] for _, s, _ in results)}
        for _, stats, _ in results:
            for name in ("documents", "bytes", "skipped"):
                total[name] += stats[name]
        dtype = token_dtype(build_tokenizer(**tokenizer_kwargs(args)).vocab_size)
        for key in args.json_keys:
            with IndexedDatasetWriter(output_prefix(args.output_prefix, key), dtype) as writer:
                for part in parts:
                    writer.add_index(output_prefix(part, key))
        return total
    finally:
        for part in parts:
            for key in args.json_keys:
                for suffix in (".bin", ".idx"):
                    path = output_prefix(part, key) + suffix
                    if os.path.exists(path):
                        os.remove(path)


def get_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description="Tokenize jsonl into Megatron .bin/.idx files")
    g = parser.add_argument_group("input data")
    g.add_argument("--input", required=True, help="jsonl file, one document per line")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize; one output per key")
    g.add_argument("--split-sentences", action="store_true", help="not supported (needs nltk)")
    g.add_argument(
        "--keep-newlines",
        action="store_true",
        help="only affects --split-sentences in Megatron-LM; accepted so scripts carry over",
    )
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--tokenizer-model")
    g.add_argument("--vocab-size", type=int, help="NullTokenizer's vocabulary size")
    g.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    g = parser.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="path prefix, without _<key>_document.bin")
    g = parser.add_argument_group("runtime")
    g.add_argument("--workers", type=int, required=True, help="tokenizing processes (in all partitions)")
    g.add_argument("--partitions", type=int, default=1)
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress updates; 0: quiet")
    g.add_argument("--skip-bad-lines", action="store_true", help="count and skip malformed jsonl lines")
    args = parser.parse_args(argv)
    if args.split_sentences:
        parser.error("--split-sentences: sentence splitting (nltk) is not supported; documents are kept whole")
    if args.workers < 1 or args.partitions < 1:
        parser.error(f"--workers ({args.workers}) and --partitions ({args.partitions}) must be >= 1")
    if args.workers % args.partitions:
        parser.error(f"--workers ({args.workers}) must be a multiple of --partitions ({args.partitions})")
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input}: no such file")
    directory = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(directory):
        parser.error(f"--output-prefix {args.output_prefix}: directory {directory} does not exist")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = get_args(argv)
    try:
        build_tokenizer(**tokenizer_kwargs(args))
        stats = process_partitions(args) if args.partitions > 1 else process(args, args.output_prefix)
    except EXPECTED_ERRORS as error:
        sys.exit(report_error(error))
    seconds = max(stats["seconds"], 1e-9)
    outputs = ", ".join(output_prefix(args.output_prefix, key) + ".{bin,idx}" for key in args.json_keys)
    skipped = f", skipped {stats['skipped']} bad lines" if stats["skipped"] else ""
    print(
        f"processed {stats['documents']} documents ({stats['bytes'] / 2**20:.2f} MB) in {seconds:.2f} s: "
        f"{stats['documents'] / seconds:.1f} docs/s, {stats['bytes'] / seconds / 2**20:.3f} MB/s{skipped}; "
        f"wrote {outputs}"
    )
    return stats


if __name__ == "__main__":
    main()
