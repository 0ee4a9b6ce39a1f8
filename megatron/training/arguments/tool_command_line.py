"""The tools' command line (tools/estimate_memory.py, tools/plan_parallelism.py, tools/bench/):
the same model / parallel / batch flags as pretrain_*.py (parsed by `parse_run_config`) plus
the tools' own."""

from __future__ import annotations

import argparse

from megatron.planning.hardware import DEVICES
from megatron.training.arguments.parser import GPT_DEFAULTS, LLAMA_DEFAULTS, ArgumentError, parse_run_config

FAMILIES = {"gpt": GPT_DEFAULTS, "llama": LLAMA_DEFAULTS}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ArgumentError(message)


def tool_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description=description, allow_abbrev=False, add_help=False)
    parser.add_argument("--num-gpus", type=int, required=True, help="world size (all GPUs of the job)")
    parser.add_argument(
        "--model-family",
        choices=sorted(FAMILIES),
        default="gpt",
        help="defaults of pretrain_gpt.py or pretrain_llama.py",
    )
    parser.add_argument(
        "--device",
        choices=sorted(DEVICES),
        help="a GPU preset (megatron/planning/hardware.py): its memory, and for the planner its "
        "FLOP/s and bandwidths; each overridden by the flags that name it",
    )
    parser.add_argument(
        "--device-memory-gb",
        type=float,
        help="device memory in GiB (default: the --device preset's, else this CUDA device's)",
    )
    parser.add_argument(
        "--device-type",
        choices=["cuda", "cpu"],
        default="cuda",
        help="device the run will use: decides the attention/norm/dropout kernels (default cuda)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _without(argv: list[str], flag: str) -> list[str]:
    """argv without `flag` and the values following it (for nargs='*' flags like --data-path)."""
    out, skipping = [], False
    for token in argv:
        if token == flag or token.startswith(flag + "="):
            skipping = token == flag
            continue
        if skipping and not token.startswith("--"):
            continue
        skipping = False
        out.append(token)
    return out


def _given(argv: list[str], flag: str) -> bool:
    return any(t == flag or t.startswith(flag + "=") for t in argv)


def run_config_for_tool(rest: list[str], family: str, world_size: int, prog: str):
    """The RunConfig of pretrain_*.py flags `rest`, without data: the vocabulary is --vocab-size's or, as in
    training, --tokenizer-type's (its files read); --mock-data and --train-iters are filled in, --data-path
    is ignored."""
    if world_size < 1:
        raise ArgumentError(f"--num-gpus must be >= 1, got {world_size}")
    if not _given(rest, "--vocab-size") and not _given(rest, "--tokenizer-type"):
        raise ArgumentError("--vocab-size (or --tokenizer-type with its files) is required: it sets the vocabulary")
    argv = _without(rest, "--data-path")
    if "--mock-data" not in argv:
        argv.append("--mock-data")
    if not _given(argv, "--train-iters"):
        argv += ["--train-iters", "1"]
    return parse_run_config(argv, FAMILIES[family], world_size, prog)


def parse_tool_command_line(parser: argparse.ArgumentParser, argv: list[str]):
    """(tool args, RunConfig) for estimate_memory.py."""
    args, rest = parser.parse_known_args(argv)
    if args.device_memory_gb is not None and args.device_memory_gb <= 0:
        raise ArgumentError(f"--device-memory-gb must be > 0, got {args.device_memory_gb}")
    return args, run_config_for_tool(rest, args.model_family, args.num_gpus, parser.prog)
