"""The memory estimate of every pipeline rank: model states + activation peak + transients.

All tp, cp and dp ranks of one pipeline stage hold identical shapes, so one
`RankEstimate` per pipeline rank describes the whole world. A rank's peak is

    weights + grads + optimizer + max(activations + transients,
                                      after-backward temporaries + runtime allowance)

because the optimizer step (and the tied-embedding gradient reduction) run after
the last backward, when no activation is alive.

Parameter shapes and saved activations are traced from our modules (trace.py), the
microbatches in flight walked on our schedule (inflight.py), the buffers laid out by the
trainer's own BufferLayout (model_states.py). MoE layers are traced at the balanced load, their
routing imbalance is an allowance (moe_routing.py).

Only part of that is certain: weights, gradients, optimizer state and saved
activations (`certain_bytes`) equal measured bytes on CPU; the transients and the
after-backward temporaries are derived from our code's shapes but unmeasured, and the
allowances (fragmentation, runtime, NCCL buffers per communicator, document masks, MoE
routing imbalance, context parallelism's terms: `RankEstimate.uncertain`) are assumptions. Whether
a layout fits is decided once, by fit_rule.fit_verdict, for the planner, the start-up check and the
tools alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from megatron.planning.communicators import communicators
from megatron.planning.fit_rule import fit_verdict
from megatron.planning.inflight import peak_pending_weight_steps, rank_in_flight
from megatron.planning.kernels import KernelChoice, resolve_kernels
from megatron.planning.layout import MemoryLayout
from megatron.planning.model_states import chunk_buffers, model_states, optimizer_step_temporary
from megatron.planning.moe_routing import describe, imbalance_label, imbalance_load
from megatron.planning.parameters import numel, rank_chunks, total_parameters, weight_gradient_shapes
from megatron.planning.trace import Setting, chunk_saved
from megatron.planning.transients import (
    Allowances,
    Dims,
    Transients,
    after_backward_temporary,
    cp_attention_bytes,
    estimate_transients,
    largest_temporary,
    moe_dispatch_bytes,
    pending_weight_step_bytes,
    split_backward_bytes,
)


@dataclass(frozen=True)
class RankEstimate:
    pp_rank: int
    parameters: int
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    transients_bytes: int
    after_backward_bytes: int
    host_bytes: int
    peak_microbatches: int
    chunk_activation_bytes: tuple[int, ...]  # one microbatch on each local chunk
    transients: Transients
    gathered_bytes: int = 0  # whole buckets of sharded gradients/parameters during forward/backward

    @property
    def states_bytes(self) -> int:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def certain_bytes(self) -> int:
        """Model states + saved activations: the part measurement confirms exactly (docs/memory.md)."""
        return self.states_bytes + self.activations_bytes

    @property
    def _during_backward(self) -> int:
        return self.activations_bytes + self.transients_bytes + self.gathered_bytes

    @property
    def _after_backward(self) -> int:
        return self.after_backward_bytes + self.transients.fixed_bytes

    @property
    def peaks_after_backward(self) -> bool:
        """Whether the peak is the optimizer step's (no activation alive) rather than the backward's."""
        return self._after_backward > self._during_backward

    @property
    def total_bytes(self) -> int:
        return self.states_bytes + max(self._during_backward, self._after_backward)

    def uncertain(self) -> dict[str, int]:
        """The allowances of the phase that sets the peak, by name, largest first (zeros left out):
        the estimate's uncertain part (fit_rule.py)."""
        return _largest_first(self.transients.allowances(after_backward=self.peaks_after_backward))

    def allowances(self) -> dict[str, int]:
        """The unmeasured components of the phase that sets the peak, largest first (zeros left out):
        its derived transients and its allowances."""
        if self.peaks_after_backward:
            derived = {"after-backward temporaries": self.after_backward_bytes}
        else:
            derived = dict(self.transients.derived(), **{"gathered buckets": self.gathered_bytes})
        return _largest_first({**derived, **self.uncertain()})

    def to_dict(self) -> dict:
        out = {
            name: getattr(self, name)
            for name in (
                "pp_rank",
                "parameters",
                "weights_bytes",
                "grads_bytes",
                "optimizer_bytes",
                "activations_bytes",
                "transients_bytes",
                "host_bytes",
                "certain_bytes",
                "total_bytes",
                "after_backward_bytes",
                "peak_microbatches",
                "gathered_bytes",
            )
        }
        out["chunk_activation_bytes"] = list(self.chunk_activation_bytes)
        out["transients"] = asdict(self.transients)
        out["allowances"] = self.allowances()
        out["uncertain"] = self.uncertain()
        return out


def _largest_first(parts: dict[str, int]) -> dict[str, int]:
    return dict(sorted(((k, v) for k, v in parts.items() if v), key=lambda kv: -kv[1]))


@dataclass(frozen=True)
class MemoryEstimate:
    ranks: tuple[RankEstimate, ...]
    total_parameters: int
    kernels: KernelChoice
    layout: MemoryLayout
    moe_routing: str | None = None  # what the estimate assumes of MoE routing (moe_routing.describe)

    @property
    def max_total_bytes(self) -> int:
        return max(r.total_bytes for r in self.ranks)

    @property
    def max_certain_bytes(self) -> int:
        return max(r.certain_bytes for r in self.ranks)

    @property
    def worst_rank(self) -> RankEstimate:
        return max(self.ranks, key=lambda r: r.total_bytes)

    @property
    def worst_certain_rank(self) -> RankEstimate:
        return max(self.ranks, key=lambda r: r.certain_bytes)

    def fits(self, device_bytes: int) -> bool:
        """fit_verdict's "fits": what the planner keeps."""
        return fit_verdict(self, device_bytes).fits

    def would_refuse(self, device_bytes: int | None) -> bool:
        """fit_verdict's "does not fit": what the start-up check refuses (no device memory known: never)."""
        return device_bytes is not None and fit_verdict(self, device_bytes).refused

    def to_dict(self, device_bytes: int | None = None) -> dict:
        verdict = None if device_bytes is None else fit_verdict(self, device_bytes)
        return {
            "ranks": [r.to_dict() for r in self.ranks],
            "total_parameters": self.total_parameters,
            "max_certain_bytes": self.max_certain_bytes,
            "max_total_bytes": self.max_total_bytes,
            "device_memory_bytes": device_bytes,
            "verdict": None if verdict is None else verdict.label,
            "margin_bytes": None if verdict is None else verdict.margin_bytes,
            "fits": None if verdict is None else verdict.fits,
            "would_refuse": self.would_refuse(device_bytes),
            "layout": self.layout.to_dict(),
            "kernels": asdict(self.kernels),
            "moe_routing": self.moe_routing,
        }


def _with_attention(config, attention: str):
    """The config whose attention backend runs `attention` (an implementation asked for, not the model's own)."""
    backend = {"triton": "triton", "flash": "torch", "efficient": "torch", "math": "torch"}.get(attention)
    if (
        backend is None
        or config.attention_backend == backend
        or (backend == "triton" and config.attention_backend == "auto")
    ):
        return config
    return dataclasses.replace(config, attention_backend=backend)


def estimate_rank(
    config, layout: MemoryLayout, kernels: KernelChoice, allowances: Allowances, pp_rank: int
) -> RankEstimate:
    par = layout.parallel
    chunks = rank_chunks(config, layout, pp_rank)
    per_chunk = [chunk_buffers(config, layout, c) for c in chunks]
    buffers = [b for c in per_chunk for b in c]
    states = model_states(config, layout, per_chunk)
    setting = Setting(par.tp, par.cp, layout.micro_batch_size, layout.device_type, kernels.attention)
    traced = _with_attention(config, kernels.attention)
    activations = [chunk_saved(traced, setting, c.pre_process, c.post_process, c.layer_ids) for c in chunks]
    dims = Dims.of(config, layout)
    inflight = rank_in_flight(
        layout, pp_rank, [a.bytes for a in activations], dims.residual_bytes, [a.shared_bytes for a in activations]
    )
    moe = any(config.is_moe_layer(i) for c in chunks for i in c.layer_ids)
    tied = not config.untie_embeddings_and_output_weights
    gradients = {s for c in chunks for s in weight_gradient_shapes(config, par.tp, c)}
    largest = largest_temporary(
        dims,
        config,
        max(map(numel, gradients), default=0),
        has_last=any(c.post_process for c in chunks),
        tied_in_one_stage=tied and any(c.pre_process and c.post_process for c in chunks),
        recompute_working=max(a.recompute_bytes for a in activations),
        moe=moe,
        cross_entropy=kernels.cross_entropy,
    )
    pending = peak_pending_weight_steps(layout, pp_rank)
    if pending:  # zero-bubble: WEIGHT steps wait with their inputs and output gradients
        split = pending * max(pending_weight_step_bytes(dims, config, len(c.layer_ids)) for c in chunks)
    else:
        split = max(split_backward_bytes(dims, config, len(c.layer_ids)) for c in chunks) if par.splits_backward else 0
    transients = estimate_transients(
        dims,
        layout,
        allowances,
        p2p_extra=inflight.p2p_extra_bytes,
        split_bytes=split,
        cp_bytes=cp_attention_bytes(dims, par.cp, config.cp_comm_type),
        largest=largest,
        activations=inflight.activations_bytes,
        communicators=communicators(config, layout, pp_rank, moe),
        microbatches_in_flight=inflight.peak_microbatches,
        moe_dispatch=moe_dispatch_bytes(dims, config) if moe else 0,
        moe_imbalance=_routing_imbalance(
            traced, setting, layout, pp_rank, chunks, dims.residual_bytes, inflight.activations_bytes
        ),
    )
    # the all-reduce of a copy tied across ranks (under zbv both copies are on rank 0, added in place)
    has_copy = (
        tied
        and par.stages > 1
        and par.placement.kind == "loop"
        and any(c.pre_process or c.post_process for c in chunks)
    )
    after = after_backward_temporary(
        dims, layout, optimizer_step_temporary(buffers, layout.offload_fractions.optimizer), has_copy
    )
    return RankEstimate(
        pp_rank=pp_rank,
        parameters=states.parameters,
        weights_bytes=states.weights_bytes,
        grads_bytes=states.grads_bytes,
        optimizer_bytes=states.optimizer_bytes,
        activations_bytes=inflight.activations_bytes,
        transients_bytes=transients.total,
        after_backward_bytes=after,
        host_bytes=states.host_bytes,
        peak_microbatches=inflight.peak_microbatches,
        chunk_activation_bytes=tuple(a.bytes + a.shared_bytes for a in activations),
        transients=transients,
        gathered_bytes=states.gathered_bytes,
    )


def _routing_imbalance(config, setting: Setting, layout, pp_rank: int, chunks, residual: int, balanced: int):
    """The "MoE routing imbalance" allowance (moe_routing.py) as (bytes, name): the in-flight activation
    peak with the experts at the imbalance load, less the balanced one (`balanced`)."""
    load = imbalance_load(config)
    if load is None:
        return 0, ""
    uneven = dataclasses.replace(setting, routing_load=load)
    saved = [chunk_saved(config, uneven, c.pre_process, c.post_process, c.layer_ids) for c in chunks]
    peak = rank_in_flight(layout, pp_rank, [a.bytes for a in saved], residual, [a.shared_bytes for a in saved])
    return max(0, peak.activations_bytes - balanced), imbalance_label(config)


def _check_split(config, layout: MemoryLayout) -> None:
    """The model config must be split as the layout is (one line naming the flag otherwise)."""
    par = layout.parallel
    sizes = [
        ("--tensor-model-parallel-size", config.tensor_model_parallel_size, par.tp),
        ("--context-parallel-size", config.context_parallel_size, par.cp),
    ]
    if config.num_moe_experts is not None:
        sizes += [
            ("--expert-model-parallel-size", config.expert_model_parallel_size, par.ep),
            ("--expert-tensor-parallel-size", config.expert_tensor_parallel_size, par.dims.etp),
        ]
    for flag, configured, laid_out in sizes:
        if configured != laid_out:
            raise ValueError(f"{flag}: the model config is split for {configured} but the layout has {laid_out}")


def estimate_memory(
    config, layout: MemoryLayout, *, attention: str = "auto", allowances: Allowances | None = None
) -> MemoryEstimate:
    """Estimate every pipeline rank of `layout` training `config` (a TransformerConfig)."""
    _check_split(config, layout)
    kernels = resolve_kernels(config, layout.device_type, attention)
    allowances = allowances or Allowances.default(layout.device_type)
    ranks = tuple(estimate_rank(config, layout, kernels, allowances, r) for r in range(layout.parallel.pp))
    return MemoryEstimate(ranks, total_parameters(config, layout.parallel.tp), kernels, layout, describe(config))
