"""Print training samples K..N-1 exactly as the trainer reads them (same flags, same order).

    python tools/inspect_data.py --data-path 0.3 A 0.7 B --seq-length 1024 --seed 1234 \\
        --train-iters 100 --global-batch-size 32 --tokenizer-type GPT2BPETokenizer \\
        --vocab-file vocab.json --merge-file merges.txt --samples 0:4

Each sample is its seq_length + 1 token ids (inputs plus the final label) and, with a
tokenizer, their decoded text. --json prints one JSON list of lists of ids instead.
Index caches are read (or built) where the trainer would, so the two agree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron.data.builder import build_datasets  # noqa: E402
from megatron.data.tokenizers import build_tokenizer  # noqa: E402
from megatron.training.arguments.data import add_data_arguments, data_config_from_args  # noqa: E402
from megatron.training.arguments.errors import EXPECTED_ERRORS, report_error  # noqa: E402


def parse_range(text: str) -> range:
    try:
        start, stop = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--samples {text!r}: expected K:N, e.g. 0:4") from None
    if not 0 <= start < stop:
        raise ValueError(f"--samples {text!r}: need 0 <= K < N")
    return range(start, stop)


def get_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_arguments(parser)
    parser.add_argument("--vocab-size", type=int, help="NullTokenizer's vocabulary size")
    parser.add_argument("--seq-length", type=int, required=True)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--train-samples", type=int)
    parser.add_argument("--train-iters", type=int)
    parser.add_argument("--global-batch-size", type=int)
    parser.add_argument("--samples", default="0:1", help="K:N, the training samples to print")
    parser.add_argument("--json", action="store_true", help="print one JSON list of lists of token ids")
    return parser.parse_args(argv)


def train_samples(args) -> int:
    if args.train_samples is not None:
        return args.train_samples
    if args.train_iters is None or args.global_batch_size is None:
        raise ValueError("give --train-samples, or --train-iters with --global-batch-size")
    return args.train_iters * args.global_batch_size


def main(argv: list[str] | None = None) -> None:
    args = get_args(argv)
    try:
        samples = parse_range(args.samples)
        config = data_config_from_args(args)
        tokenizer = build_tokenizer(**config.tokenizer_args()) if args.tokenizer_type else None
        train, _, _ = build_datasets(config, tokenizer, args.seq_length, args.seed, train_samples(args), 0, 0)
        if train is None or samples.stop > len(train):
            raise ValueError(
                f"--samples {args.samples}: the train dataset has {0 if train is None else len(train)} samples"
            )
    except EXPECTED_ERRORS as error:
        sys.exit(report_error(error))
    rows = [train.sample_tokens(i).tolist() for i in samples]
    if args.json:
        print(json.dumps(rows))
        return
    for i, ids in zip(samples, rows):
        print(f"sample {i}: {' '.join(map(str, ids))}")
        if tokenizer is not None:
            print(f"text {i}: {tokenizer.detokenize(ids)!r}")


if __name__ == "__main__":
    main()
