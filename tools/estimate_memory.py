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
(the world size) and --device (a GPU preset of megatron/planning/hardware.py, whose memory
is the limit unless --device-memory-gb is given). Prints one row per pipeline rank (weights,
grads, optimizer on the device, activations, transients, certain, total, host: offloaded
optimizer state, % of device), or --json.

--explain adds every rank's components by name: the certain part, the derived transients and
the allowances (fragmentation, runtime, NCCL buffers per communicator, with
--reset-attention-mask the document masks: the data's flag, accepted here without --data-path,
and with MoE layers the routing imbalance: their activations are estimated at the balanced load,
docs/moe.md).

The last line is the fit verdict (megatron/planning/fit_rule.py), the same the planner and the
start-up check give: "fits", "fits with margin X" (the certain part fits, the full estimate does
not: the start-up check warns) or "does not fit" (the certain part -- weights, grads,
optimizer, saved activations -- exceeds device memory). Exit status: 1 for "does not fit" (the
start-up check would refuse the run), 0 otherwise; 2 on invalid input (one error line).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron.planning.budget import device_memory_bytes  # noqa: E402
from megatron.planning.estimator import estimate_memory  # noqa: E402
from megatron.planning.fit_rule import fit_verdict  # noqa: E402
from megatron.planning.startup_check import allowance_warning, explain, format_table, refusal  # noqa: E402
from megatron.training.arguments.parser import GPT_DEFAULTS, build_parser  # noqa: E402
from megatron.training.arguments.tool_command_line import parse_tool_command_line, tool_parser  # noqa: E402
from megatron.training.memory_check import layout_from_run  # noqa: E402

PROG = "tools/estimate_memory.py"


def main(argv: list[str]) -> int:
    parser = tool_parser(PROG, "Per-rank memory estimate of a pretrain_*.py run")
    parser.add_argument("--explain", action="store_true", help="every rank's components by name")
    parser.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="the run's data builds a document mask (pretrain flag; here without --data-path): counted as an allowance",
    )
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        build_parser(GPT_DEFAULTS, "pretrain_*.py flags").print_help()
        return 0
    try:
        args, run = parse_tool_command_line(parser, argv)
        layout = dataclasses.replace(layout_from_run(run, args.device_type), document_mask=args.reset_attention_mask)
        estimate = estimate_memory(run.model, layout)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_bytes = device_memory_bytes(device, args.device_memory_gb, args.device)
    if args.json:
        print(json.dumps(estimate.to_dict(device_bytes), indent=2))
    else:
        for line in format_table(estimate, device_bytes) + (explain(estimate) if args.explain else []):
            print(line)
        print(_verdict(estimate, device_bytes))
    return 1 if estimate.would_refuse(device_bytes) else 0


def _verdict(estimate, device_bytes: int | None) -> str:
    """One line: the fit verdict and why."""
    if device_bytes is None:
        return "> no device memory known: pass --device-memory-gb to check the estimate"
    verdict = fit_verdict(estimate, device_bytes)
    if verdict.refused:
        return f"> does NOT fit, the start-up check refuses it: {refusal(estimate, device_bytes)}"
    if not verdict.fits:
        return f"> the start-up check warns: {allowance_warning(estimate, device_bytes)}"
    return f"> {verdict.describe()}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
