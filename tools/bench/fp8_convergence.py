#!/usr/bin/env python
"""FP8 convergence on CPU: a tiny Llama trained on the shipped corpus (SentencePiece, 1024 tokens) in BF16 and in
each FP8 recipe (emulated), side by side in one process; prints each recipe's mean loss over the last 50
iterations and its distance from BF16's (issue 44's target: within 1.5%).

    python tools/bench/fp8_convergence.py [--iters 300] [--recipes delayed,tensorwise,blockwise]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.training.arguments.parser import LLAMA_DEFAULTS, parse_run_config  # noqa: E402
from megatron.training.initialize import free_port  # noqa: E402
from megatron.training.trainer import Trainer  # noqa: E402

RECIPES = {
    "delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
    "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"],
}
MODEL = [
    *("--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "192", "--num-attention-heads", "4"),
    *("--seq-length", "64", "--micro-batch-size", "8", "--global-batch-size", "8", "--bf16", "--seed", "1234"),
    *("--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "20"),
    *("--weight-decay", "0.1", "--clip-grad", "1.0", "--split", "100,0,0", "--eval-iters", "0"),
]


def preprocess(out: str) -> str:
    """The shipped corpus as Megatron .bin/.idx with the shipped SentencePiece tokenizer; returns the prefix."""
    sys.path.insert(0, str(ROOT / "tools"))
    import preprocess_data

    prefix = os.path.join(out, "stories")
    preprocess_data.main(
        [
            *("--input", str(ROOT / "data/corpus/stories.jsonl"), "--tokenizer-type", "SentencePieceTokenizer"),
            *("--tokenizer-model", str(ROOT / "data/tokenizers/spm/tokenizer.model"), "--append-eod"),
            *("--output-prefix", prefix, "--workers", "1", "--log-interval", "0"),
        ]
    )
    return prefix + "_text_document"


def losses(data: str, iters: int, extra: list[str]) -> tuple[list[float], float]:
    argv = MODEL + ["--train-iters", str(iters), "--data-path", data, "--tokenizer-type", "SentencePieceTokenizer"]
    argv += ["--tokenizer-model", str(ROOT / "data/tokenizers/spm/tokenizer.model")] + extra
    trainer = Trainer(parse_run_config(argv, LLAMA_DEFAULTS, 1), torch.device("cpu"))
    start = time.perf_counter()
    out = [trainer.train_step(i).loss for i in range(1, iters + 1)]
    elapsed = time.perf_counter() - start
    trainer.close()
    return out, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as out:
        data = preprocess(out)
        bf16, bf16_s = losses(data, args.iters, [])
        reference = statistics.mean(bf16[-50:])
        print(f"{'run':<12} {'first loss':>10} {'last-50 mean':>13} {'vs bf16':>9} {'seconds':>8}")
        print(f"{'bf16':<12} {bf16[0]:>10.4f} {reference:>13.4f} {'':>9} {bf16_s:>8.1f}")
        for name in args.recipes.split(","):
            run, seconds = losses(data, args.iters, RECIPES[name])
            mean = statistics.mean(run[-50:])
            print(f"{name:<12} {run[0]:>10.4f} {mean:>13.4f} {(mean - reference) / reference:>+9.2%} {seconds:>8.1f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
