"""What a checkpoint holds of a trainer, in any format: its state as canonical pieces.

Model and optimizer state are canonical (per parameter, at its global shape: the weights, Adam
moments and, for bf16/fp16 weights, fp32 master weights), so they reshard into any layout; the
step count, loss scaler and consumed samples are metadata. RNG states (torch's generators per
rank, each model chunk's dropout streams) are bound to the parallel layout that saved them.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megatron.core.checkpointing import MOMENTS, TensorPiece, model_pieces, optimizer_state_pieces, state_name
from megatron.core.transformer.model_fields import model_record

SAVED_MASTER = functools.partial(state_name, "master")  # bf16/fp16 weights: their fp32 copies
MODEL_AS_MASTER = str  # fp32 weights saved: the model tensor itself is the master


def layout_of(trainer) -> dict:
    dims = trainer.mesh.dims
    return {
        "tp": dims.tp,
        "cp": dims.cp,
        "dp": dims.dp,
        "pp": dims.pp,
        "virtual_stages": trainer.run.parallel.virtual_stages,
    }


def named_parameters(trainer):
    """Every model tensor a checkpoint holds: the parameters, and the buffers that carry an InitSpec (state
    that training changes outside the optimizer: the MoE router's expert bias)."""
    for chunk in trainer.chunks:
        yield from chunk.module.named_parameters()
        yield from ((name, b) for name, b in chunk.module.named_buffers() if hasattr(b, "init_spec"))


def optimizer_pieces(trainer, *, tied_copies: bool, master=None) -> list[TensorPiece]:
    """The optimizer's per-parameter state as canonical pieces (see
    megatron.core.checkpointing.optimizer_state), written beside the model and filled in place on
    load. `master`: the checkpoint name of a parameter's master weights (None: left out)."""
    sources = {key: functools.partial(state_name, key) for key in MOMENTS}
    if master is not None:
        sources["master"] = master
    return optimizer_state_pieces(
        trainer.optimizer.state_dict_by_name(), dict(named_parameters(trainer)), sources, tied_copies=tied_copies
    )


def _low_precision(trainer) -> bool:
    """Whether the weights are bf16/fp16, so that their fp32 master weights are a separate state."""
    return trainer.run.model.params_dtype != torch.float32


def rng_states(trainer) -> dict[str, torch.Tensor]:
    """Name -> state of torch's generators on this rank and of each model chunk's dropout streams
    (named by global stage, cp and tp rank: equal on dp replicas, which DCP writes once)."""
    mesh, rank = trainer.mesh, dist.get_rank()
    states = {f"rng.torch.rank_{rank:05d}": torch.get_rng_state()}
    if trainer.device.type == "cuda":
        states[f"rng.cuda.rank_{rank:05d}"] = torch.cuda.get_rng_state(trainer.device)
    for c, chunk in enumerate(trainer.chunks):
        stage = c * mesh.pp_size + mesh.pp_rank
        for tensor_parallel, state in chunk.module.decoder.rng_tracker.get_state().items():
            stream = "tensor_parallel" if tensor_parallel else "replicated"
            states[f"rng.dropout.stage_{stage}.cp_{mesh.cp_rank}.tp_{mesh.tp_rank}.{stream}"] = state
    return states


def set_rng_states(trainer, states: dict[str, torch.Tensor]) -> None:
    rank = dist.get_rank()
    torch.set_rng_state(states[f"rng.torch.rank_{rank:05d}"])
    if trainer.device.type == "cuda":
        torch.cuda.set_rng_state(states[f"rng.cuda.rank_{rank:05d}"], trainer.device)
    mesh = trainer.mesh
    for c, chunk in enumerate(trainer.chunks):
        prefix = f"rng.dropout.stage_{c * mesh.pp_size + mesh.pp_rank}.cp_{mesh.cp_rank}.tp_{mesh.tp_rank}"
        chunk.module.decoder.rng_tracker.set_state(
            {False: states[f"{prefix}.replicated"], True: states[f"{prefix}.tensor_parallel"]}
        )


def consumed_samples(run, iteration: int) -> int:
    """Samples consumed by iterations 1..iteration (with a growing batch size, not iteration x G)."""
    return run.training.batch_schedule.consumed_before(iteration + 1)


def checkpoint_contents(
    trainer, iteration: int, rng: bool = True, log_window: dict | None = None
) -> tuple[list[TensorPiece], dict]:
    """(this rank's pieces: model, optimizer state and, with `rng`, RNG states; the metadata) of a
    save after `iteration`, with the log's open averaging window when given. The pieces are views
    of the live tensors."""
    trainer.optimizer.finish_param_sync()  # --overlap-param-gather: the weights must be whole
    master = SAVED_MASTER if _low_precision(trainer) else None  # fp32 weights are their own master
    pieces = (
        model_pieces(named_parameters(trainer), tied_copies=False)
        + optimizer_pieces(trainer, tied_copies=False, master=master)
        + ([TensorPiece.whole(name, state) for name, state in rng_states(trainer).items()] if rng else [])
    )
    metadata = {
        "consumed_samples": consumed_samples(trainer.run, iteration),
        "update_samples": trainer.run.training.batch_schedule.update_samples(trainer.optimizer.adam.step_count),
        "model": model_record(trainer.run.model),
        "layout": layout_of(trainer),
        "optimizer": {**trainer.optimizer.scalar_state(), "master_weights": master is not None},
        "contents": ["model", "optimizer"] + (["rng"] if rng else []),
    }
    if log_window is not None:
        metadata["log_window"] = log_window
    return pieces, metadata
