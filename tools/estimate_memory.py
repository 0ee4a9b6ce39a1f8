#!/usr/bin/env python
"""Estimate the peak memory of every rank of a training run before launching it.

    python tools/estimate_memory.py --num-gpus 8 --model-family llama --device-memory-gb 80 \\
        --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 \\
        --seq-length 4096 --vocab-size 32000 --micro-batch-size 1 --global-batch-size 64 --bf16 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel

Takes the model / parallel / batch flags of pretrain_gpt.py / pretrain_llama.py
(--model-family picks whose defaults; --context-parallel-size,
--use-distributed-optimizer, --ddp-bucket-size, --decoder-first/last-pipeline-num-layers and
the offload optimizer's --optimizer-cpu-offload, --optimizer-offload-fraction and
--offload-policy included; auto is estimated as full offload, its best case) plus --num-gpus
(the world size) and --device (a GPU preset: a100-40gb, a100-80gb, h100-80gb, h200, whose memory
is the limit unless --device-memory-gb is given). Prints one row per pipeline rank (weights,
grads, optimizer on the device, activations, transients, certain, total, host: offloaded
optimizer state, % of device), or --json.

Exit status follows the start-up check: 1 when it would refuse the run (the
certain part of a rank -- weights, grads, optimizer, saved activations --
exceeds device memory), 0 otherwise, including when only the unmeasured
allowances exceed it or the estimate is above 80% (both said in the verdict
line); 2 on invalid input (one error line).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron.planning.budget import device_memory_bytes  # noqa: E402
from megatron.planning.estimator import DEFAULT_THRESHOLD, estimate_memory  # noqa: E402
from megatron.planning.startup_check import allowance_warning, format_table, refusal  # noqa: E402
from megatron.training.arguments.parser import GPT_DEFAULTS, build_parser  # noqa: E402
from megatron.training.arguments.tool_command_line import parse_tool_command_line, tool_parser  # noqa: E402
from megatron.training.memory_check import layout_from_run  # noqa: E402

PROG = "tools/estimate_memory.py"


def main(argv: list[str]) -> int:
    parser = tool_parser(PROG, "Per-rank memory estimate of a pretrain_*.py run")
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        build_parser(GPT_DEFAULTS, "pretrain_*.py flags").print_help()
        return 0
    try:
        args, run = parse_tool_command_line(parser, argv)
        layout = layout_from_run(run, args.device_type)
        estimate = estimate_memory(run.model, layout)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_bytes = device_memory_bytes(device, args.device_memory_gb, args.device)
    if args.json:
        print(json.dumps(estimate.to_dict(device_bytes, DEFAULT_THRESHOLD), indent=2))
    else:
        for line in format_table(estimate, device_bytes):
            print(line)
        print(_verdict(estimate, device_bytes))
    return 1 if estimate.would_refuse(device_bytes) else 0


def _verdict(estimate, device_bytes: int | None) -> str:
    """One line: the start-up check's decision and why."""
    if device_bytes is None:
        return "> no device memory known: pass --device-memory-gb to check the estimate"
    if estimate.would_refuse(device_bytes):
        return f"> does NOT fit, the start-up check refuses it: {refusal(estimate, device_bytes)}"
    share = f"worst rank {estimate.max_total_bytes / device_bytes:.1%} of device memory"
    if estimate.max_total_bytes > device_bytes:
        return f"> may not fit, the start-up check warns: {allowance_warning(estimate, device_bytes)}"
    if not estimate.fits(device_bytes):
        return (
            f"> may not fit: {share}, above the {DEFAULT_THRESHOLD:.0%} below which no run of Fujii et al. "
            f"ran out of memory; the start-up check warns"
        )
    return f"> fits: {share} (threshold {DEFAULT_THRESHOLD:.0%})"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
