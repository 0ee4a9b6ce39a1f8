"""Glue between the command line / RunConfig and the memory estimator.

- `check_memory`: what pretrain_*.py runs at start-up: estimate every rank, return
  the per-rank table as log lines; refuse (ValueError, one line) only when the
  certain part of a rank's estimate (weights, gradients, optimizer state, saved
  activations: what measurement confirms) exceeds device memory, unless told to
  skip the check; warn, naming the unmeasured allowances, when only the full
  estimate does. A check that refuses a job that would run is worse than none;
- `parse_tool_command_line`: the tools' command line: the same model / parallel /
  batch flags as pretrain_*.py (parsed by `parse_run_config`) plus the tools' own.
"""

from __future__ import annotations

import argparse
import os

import torch

from megatron.core.memory.estimator import DEFAULT_THRESHOLD, MemoryEstimate, estimate_memory
from megatron.core.memory.hardware import DEVICES
from megatron.core.memory.layout import MemoryLayout
from megatron.training.arguments import GPT_DEFAULTS, LLAMA_DEFAULTS, ArgumentError, parse_run_config

GIB = float(1 << 30)
FAMILIES = {"gpt": GPT_DEFAULTS, "llama": LLAMA_DEFAULTS}
COLUMNS = ("weights", "grads", "optimizer", "activations", "transients", "certain", "total", "host")


def layout_from_run(run, device_type: str, *, distributed_optimizer: bool | None = None) -> MemoryLayout:
    """The layout `run` trains with; `distributed_optimizer` overrides its --use-distributed-optimizer
    (None: keep it), to compare the two optimizers on one run (the replicated one without offload).
    --offload-policy auto is estimated as full offload (every part the strategy can move on host):
    the best case, so the start-up check refuses only a run that cannot fit even then."""
    par, training, offload = run.parallel, run.training, run.optimizer.offload
    ddp = par.ddp
    sharded = ddp.use_distributed_optimizer if distributed_optimizer is None else distributed_optimizer
    strategy = "no_shard" if not sharded else ddp.sharding_strategy if ddp.sharding_strategy != "no_shard" else "optim"
    offloaded = offload.enabled and sharded
    auto = offloaded and offload.policy == "auto"
    fractions = (
        (1.0, float(strategy in ("optim_grads", "optim_grads_params")), float(strategy == "optim_grads_params"))
        if auto
        else (offload.fraction, offload.grad_fraction, offload.param_fraction)
        if offloaded
        else (0.0, 0.0, 0.0)
    )
    return MemoryLayout(
        tp=par.tp,
        cp=par.cp,
        pp=par.pp,
        dp=par.dp,
        virtual_stages=par.virtual_stages,
        microbatch_group_size=par.microbatch_group_size,
        micro_batch_size=training.micro_batch_size,
        num_microbatches=training.num_microbatches,
        distributed_optimizer=sharded,
        bucket_size=ddp.bucket_size,
        first_stage_layers=par.first_stage_layers,
        last_stage_layers=par.last_stage_layers,
        offload_fraction=fractions[0],
        grad_offload_fraction=fractions[1],
        param_offload_fraction=fractions[2],
        offload_auto=auto,
        grad_dtype_bytes=ddp.grad_dtype.itemsize,
        device_type=device_type,
        split_backward=par.split_backward,
        sharding_strategy=strategy,
        reshard_after_forward=ddp.reshard_after_forward,
        unsharded_grad_accumulation=ddp.unsharded_grad_accumulation and strategy != "optim",
    )


def device_memory_bytes(device: torch.device, device_memory_gb: float | None, preset: str | None = None) -> int | None:
    """`--device-memory-gb` (GiB, 2**30 bytes), else the `--device` preset's, else the CUDA device's total
    memory, else None (no limit known)."""
    if device_memory_gb is not None:
        return int(device_memory_gb * GIB)
    if preset is not None:
        return int(DEVICES[preset].memory_gib * GIB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def _size(nbytes: int) -> str:
    """Bytes in GiB, or MiB below 1 GiB (tiny CPU models would print 0.00 GiB)."""
    if nbytes < GIB:
        return f"{nbytes / (1 << 20):.2f} MiB"
    return f"{nbytes / GIB:.2f} GiB"


def format_table(estimate: MemoryEstimate, device_bytes: int | None) -> list[str]:
    layout = estimate.layout
    device = f"{_size(device_bytes)} device" if device_bytes else "no device limit"
    scale, unit = (GIB, "GiB") if estimate.max_total_bytes >= GIB else (float(1 << 20), "MiB")
    lines = [
        f"> memory estimate per rank in {unit} ({layout.describe()}, {estimate.kernels.describe()}, "
        f"{layout.device_type}, {device}; identical on every tp/cp/dp rank of a pipeline stage; certain = "
        f"weights + grads + optimizer + activations, total adds the unmeasured transients; host: the "
        f"host-resident chunk state (offloaded optimizer state, gradient and parameter shards), not on the "
        f"device):",
        "  pp rank      parameters " + " ".join(f"{c:>11}" for c in COLUMNS) + "  % device (certain / total)",
    ]
    for r in estimate.ranks:
        values = (
            r.weights_bytes,
            r.grads_bytes,
            r.optimizer_bytes,
            r.activations_bytes,
            r.transients_bytes,
            r.certain_bytes,
            r.total_bytes,
            r.host_bytes,
        )
        share = (
            f"{100.0 * r.certain_bytes / device_bytes:9.1f}% / {100.0 * r.total_bytes / device_bytes:.1f}%"
            if device_bytes
            else "        -"
        )
        lines.append(
            f"  {r.pp_rank:7d} {r.parameters:15,d} " + " ".join(f"{v / scale:>11.2f}" for v in values) + f"  {share}"
        )
    worst = estimate.worst_rank
    lines.append(
        f"> total parameters {estimate.total_parameters:,}; worst rank: pp rank {worst.pp_rank} "
        f"({worst.peak_microbatches} microbatch-chunks in flight, largest temporary "
        f"{worst.transients.largest_temporary})"
    )
    if layout.offload_auto:
        lines.append(
            "> offload policy auto: estimated with every movable part on host, the best case (the start-up "
            "check refuses only what cannot fit even so); the placement below keeps on the device what fits"
        )
    return lines


def _components(rank) -> str:
    return (
        f"weights {_size(rank.weights_bytes)} + grads {_size(rank.grads_bytes)} + optimizer "
        f"{_size(rank.optimizer_bytes)} + saved activations {_size(rank.activations_bytes)}"
    )


def refusal(estimate: MemoryEstimate, device_bytes: int) -> str:
    """The one-line reason the start-up check refuses a layout (`estimate.would_refuse(device_bytes)`)."""
    rank = estimate.worst_certain_rank
    return (
        f"the certain part of the memory estimate, {_size(rank.certain_bytes)} on pipeline rank {rank.pp_rank} "
        f"({_components(rank)}), exceeds device memory {_size(device_bytes)}; raise tensor/pipeline "
        f"parallelism, recompute activations, lower --micro-batch-size or offload optimizer state "
        f"({_offload_hint(estimate.layout)}; tools/plan_parallelism.py ranks layouts that fit and proposes "
        f"the offload fraction), or pass --skip-memory-check"
    )


def _offload_hint(layout: MemoryLayout) -> str:
    if layout.offload_fraction == 1.0:
        return "all of it is already on host"
    if layout.offload_fraction:
        return "raise --optimizer-offload-fraction"
    return "--use-distributed-optimizer --optimizer-cpu-offload"


def allowance_warning(estimate: MemoryEstimate, device_bytes: int) -> str:
    """Why a layout whose full estimate exceeds device memory still starts, and what may not fit."""
    rank = estimate.worst_rank
    allowances = ", ".join(f"{name} {_size(nbytes)}" for name, nbytes in rank.allowances().items())
    return (
        f"estimated peak {_size(rank.total_bytes)} (pipeline rank {rank.pp_rank}) exceeds device memory "
        f"{_size(device_bytes)}, but its certain part {_size(rank.certain_bytes)} ({_components(rank)}) fits; "
        f"the rest are unmeasured allowances, largest first: {allowances}; starting, it may run out of memory"
    )


def host_memory_bytes(device: torch.device, host_memory_gb: float | None) -> int | None:
    """`--host-memory-gb` (GiB per rank), else on CUDA the machine's available memory (MemAvailable)
    shared by the ranks on the node (LOCAL_WORLD_SIZE, 1 without a launcher); None on CPU, where
    the offloaded state shares the memory the device budget already counts."""
    if host_memory_gb is not None:
        return int(host_memory_gb * GIB)
    if device.type != "cuda":
        return None
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def check_host(estimate: MemoryEstimate, host_bytes: int | None, skip: bool) -> str | None:
    """None when every rank's host part (its host slab: offloaded optimizer state, host-resident
    gradient and parameter shards) fits `host_bytes` (or no host
    budget applies); else the one-line refusal (ValueError) or, with --skip-memory-check, a warning."""
    rank = max(estimate.ranks, key=lambda r: r.host_bytes)
    if host_bytes is None or rank.host_bytes <= host_bytes:
        return None
    reason = (
        f"the host part of the memory estimate, {_size(rank.host_bytes)} of host-resident chunk state "
        f"on pipeline rank {rank.pp_rank}, exceeds host memory {_size(host_bytes)} per rank (--host-memory-gb, "
        f"default the available memory / ranks on the node); lower --optimizer-offload-fraction (and "
        f"--grad-offload-fraction, --param-offload-fraction), use --offload-policy auto, add ranks, "
        f"or pass --skip-memory-check"
    )
    if not skip:
        raise ValueError(reason)
    return f"> WARNING (--skip-memory-check): {reason}"


def check_memory(
    run, device: torch.device, device_memory_gb: float | None, skip: bool, host_memory_gb: float | None = None
) -> list[str]:
    """Estimate `run` on `device`; return log lines, raise ValueError when its certain part cannot fit
    the device or its host part the host. MoE models are not estimated yet (their activations depend on the
    routing): a line says so (and --offload-policy auto, which needs the estimate, is refused with them)."""
    if run.model.num_moe_experts is not None:
        return ["> memory check: the memory estimate does not cover MoE layers yet; not estimated, not checked"]
    estimate = estimate_memory(run.model, layout_from_run(run, device.type))
    device_bytes = device_memory_bytes(device, device_memory_gb)
    device_line = check_estimate(estimate, device_bytes, skip)
    # auto trades host bytes for device bytes itself and refuses when nothing fits both
    # (offload_run.chunk_placement): its full-offload host figure is no reason to refuse
    host_line = (
        None if estimate.layout.offload_auto else check_host(estimate, host_memory_bytes(device, host_memory_gb), skip)
    )
    return format_table(estimate, device_bytes) + [device_line] + ([host_line] if host_line else [])


def check_estimate(estimate: MemoryEstimate, device_bytes: int | None, skip: bool) -> str:
    """The start-up check's decision as one log line; ValueError (one line) when it refuses."""
    if device_bytes is None:
        return "> memory check: no device memory to compare with (CPU without --device-memory-gb); not checked"
    peak = estimate.max_total_bytes
    if estimate.would_refuse(device_bytes):
        if not skip:
            raise ValueError(refusal(estimate, device_bytes))
        return f"> WARNING (--skip-memory-check): {refusal(estimate, device_bytes)}"
    if peak > device_bytes:
        return f"> WARNING: {allowance_warning(estimate, device_bytes)}"
    if peak > DEFAULT_THRESHOLD * device_bytes:
        return (
            f"> warning: estimated peak {_size(peak)} is above {DEFAULT_THRESHOLD:.0%} of device memory; "
            f"it may run out of memory"
        )
    return f"> memory check: estimated peak {_size(peak)} is {peak / device_bytes:.0%} of device memory"


# ----------------------------------------------------------------------------- tools' command line
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
        help="a GPU preset (megatron/core/memory/hardware.py): its memory, and for the planner its "
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


def run_config_for_tool(rest: list[str], family: str, world_size: int, prog: str):
    """The RunConfig of pretrain_*.py flags `rest`, without data: --vocab-size is required,
    --mock-data and --train-iters are filled in, --data-path is ignored."""
    if world_size < 1:
        raise ArgumentError(f"--num-gpus must be >= 1, got {world_size}")
    if not any(t == "--vocab-size" or t.startswith("--vocab-size=") for t in rest):
        raise ArgumentError("--vocab-size is required (the estimator does not read tokenizer files)")
    argv = _without(rest, "--data-path")
    if "--mock-data" not in argv:
        argv.append("--mock-data")
    if not any(t == "--train-iters" or t.startswith("--train-iters=") for t in argv):
        argv += ["--train-iters", "1"]
    return parse_run_config(argv, FAMILIES[family], world_size, prog)


def parse_tool_command_line(parser: argparse.ArgumentParser, argv: list[str]):
    """(tool args, RunConfig) for estimate_memory.py."""
    args, rest = parser.parse_known_args(argv)
    if args.device_memory_gb is not None and args.device_memory_gb <= 0:
        raise ArgumentError(f"--device-memory-gb must be > 0, got {args.device_memory_gb}")
    return args, run_config_for_tool(rest, args.model_family, args.num_gpus, parser.prog)
