"""The torchtitan rows of the throughput part: torchtitan 0.2.2's own Trainer at the check's shape, eager and
compiled, one process each (throughput_jobs.py).

torchtitan comes from the carried wheels (`WHEELS`, filled by tools/gpu_check_device.sh from
tools/gpu_check_lib/wheels.txt), which that script's device call installs into a temporary folder on
PYTHONPATH; run without it, `unpack_wheels` extracts them into a temporary folder that only the torchtitan
jobs put on their path (a wheel is a zip archive; the pure-Python ones need nothing else). Either way the
project's environment and its torch stay as they are.

A job parses torchtitan's own command line (`config_argv`), which imports torchtitan_custom.py through
`--experimental.custom_import` (synthetic tokens, the `8B-L<layers>` flavor), builds torchtitan's `Trainer` and
calls its `train_step` itself, timing the steps after the warm-up; the loss of a step is the sum of what
`forward_backward_step` returned for its microbatches (torchtitan's own token-mean). One GPU: no FSDP, so
torchtitan trains fp32 weights under bf16 autocast (its `maybe_enable_amp`), as the bare loop does;
activation checkpointing off, as in our rows. On a dry run the config is parsed and the model built on the
meta device (torchtitan's Trainer needs CUDA: its device type falls back to cuda), nothing trained.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
import zipfile
from pathlib import Path

from tools.gpu_check_lib.report import NA

WHEELS = Path(__file__).resolve().parents[2] / "wheels"
CUSTOM_IMPORT = "tools.gpu_check_lib.torchtitan_custom"


def torchtitan_source(wheels: Path = WHEELS) -> tuple[str | None, str]:
    """(folder the torchtitan jobs put on their path, where torchtitan comes from): None where this environment
    has it already (tools/gpu_check_device.sh's call installs the wheels and puts them on PYTHONPATH), else the
    wheels unpacked (`unpack_wheels`)."""
    found = importlib.util.find_spec("torchtitan")
    if found is not None:
        return None, f"torchtitan from this environment ({list(found.submodule_search_locations)[0]})"
    return unpack_wheels(wheels)


def unpack_wheels(wheels: Path = WHEELS) -> tuple[str | None, str]:
    """(folder to put on the path, what it holds) of the wheels in `wheels`; (None, why not) without a
    torchtitan wheel there."""
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not any(w.name.startswith("torchtitan-") for w in found):
        return None, f"no torchtitan wheel in {wheels} (tools/gpu_check_device.sh downloads it)"
    target = tempfile.mkdtemp(prefix="gpu_check_wheels_")
    for wheel in found:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
    return target, ", ".join(w.name for w in found)


def config_argv(job, dump_folder: str) -> list[str]:
    """torchtitan's command line for `job` (throughput_jobs.Job): the flavor of its layer count, its batch,
    the check's sequence, a constant learning rate, checkpoints and activation checkpointing off, and the
    job's own torchtitan flags (`extra_argv`: part fp8's float8 converter)."""
    flavor = f"{'dry' if job.dry_run else '8B'}-L{job.layers}"
    argv = ["--experimental.custom_import", CUSTOM_IMPORT, "--model.name", "gpu_check_llama3"]
    argv += ["--model.flavor", flavor, "--job.dump_folder", dump_folder]
    argv += ["--training.local_batch_size", str(job.micro_batch)]
    argv += ["--training.global_batch_size", str(job.micro_batch * job.microbatches)]
    argv += ["--training.seq_len", str(job.shape["seq"]), "--training.steps", str(job.warmup + job.iters)]
    argv += ["--optimizer.lr", "1e-4", "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.min_lr_factor", "1.0"]
    argv += ["--activation_checkpoint.mode", "none", "--metrics.log_freq", "1000", "--debug.seed", "1234"]
    return argv + (["--compile.enable"] if job.compile else []) + list(job.extra_argv)


def _import_failure() -> str | None:
    try:
        import torchtitan.train  # noqa: F401
    except Exception as error:  # ImportError, or a torch it does not support
        from tools.gpu_check_lib.runs import error_line

        return f"torchtitan not importable: {error_line(error)}"
    return None


def _launch_variables() -> None:
    from megatron.training.initialize import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def _dry(config) -> dict:
    """Build the spec's model for `config` on the meta device: the flavor and the custom import work."""
    import torch
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(config.model.name)
    args = spec.model_args[config.model.flavor]
    args.update_from_config(config)
    with torch.device("meta"):
        model = spec.model_cls(args)
    parameters = sum(p.numel() for p in model.parameters())
    why = "n/a (dry run): torchtitan's Trainer runs on CUDA only"
    return dict(losses=[], step_s=NA, max_allocated=NA, error=None, note=f"{why}; built {parameters:,} parameters")


def run_torchtitan(job) -> dict:
    failure = _import_failure()
    if failure:
        return dict(losses=[], step_s=None if not job.dry_run else NA, max_allocated=None, error=failure)
    from torchtitan.config import ConfigManager

    with tempfile.TemporaryDirectory(prefix="torchtitan_dump_") as dump:
        config = ConfigManager().parse_args(config_argv(job, dump))
        if job.dry_run:
            importlib.import_module(config.experimental.custom_import)  # what torchtitan's Trainer does first
            return _dry(config)
        return _train(job, config)


def _train(job, config) -> dict:
    import torch
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    from tools.gpu_check_lib.runs import error_line

    _launch_variables()
    init_logger()
    out = dict(losses=[], step_s=None, max_allocated=None, error=None)
    trainer, losses = None, []
    try:
        trainer = Trainer(config)
        forward_backward = trainer.forward_backward_step

        def recorded(**kwargs):
            loss = forward_backward(**kwargs)
            losses.append(loss.detach())
            return loss

        trainer.forward_backward_step = recorded
        data = trainer.batch_generator(trainer.dataloader)
        step_losses = []
        for step in range(1, job.warmup + job.iters + 1):
            if step == job.warmup + 1:
                torch.cuda.synchronize()
                start = time.perf_counter()
            trainer.step = step
            trainer.train_step(data)
            step_losses.append(torch.stack(losses).sum())
            losses.clear()
        torch.cuda.synchronize()
        out["step_s"] = (time.perf_counter() - start) / job.iters
        out["losses"] = [x.item() for x in step_losses]
    except (RuntimeError, ValueError, AssertionError) as error:
        out["error"] = "out of memory" if isinstance(error, torch.cuda.OutOfMemoryError) else error_line(error)
    finally:
        out["max_allocated"] = torch.cuda.max_memory_allocated()
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return out
