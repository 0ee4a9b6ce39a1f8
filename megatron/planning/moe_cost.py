"""Seconds of one MoE layer's expert part, one microbatch, on the busiest expert-parallel rank.

What an MoE layer runs in place of the dense MLP (the attention part is the dense layer's):

* the router: a [tokens, hidden] x [hidden, experts] GEMM over the tokens this rank routes (tokens / tp
  under sequence parallelism);
* the local experts (experts / ep), each two GEMMs (three matrices with SwiGLU) over the rows it is
  sent: the balanced load ceil(T k / E) from each of the ep x etp routing ranks, times the imbalance
  allowance the memory estimate uses (moe_routing.imbalance_load: 1.5 dropless, the capacity factor
  when one caps the load; experts padded to their capacity run exactly the capacity). Grouped GEMMs
  of few rows run below the dense GEMM's efficiency: a GEMM of `rows` rows takes the dense
  roofline's time x (rows + r0) / rows, with r0 = Calibration.expert_rows_half (the rows at which a
  grouped GEMM reaches half the dense GEMM's efficiency), fitted on published MoE runs;
* the shared expert, if any: a dense MLP over all tokens;
* elementwise: the experts' activation over their rows, the permutation into expert order and back
  (each routed copy of a token read and written once each way);
* the token dispatch (not overlapped with computation, as without Megatron's all-to-all overlap):
  `alltoall` sends each routed copy of a token to the rank of its expert and back (token bytes x
  top-k, the share bound for other ranks, at load x the balanced volume on the busiest rank), then,
  under expert tensor parallelism, all-gathers the received rows over etp and reduce-scatters the
  outputs; `allgather` all-gathers every token over the ep x etp ranks and reduce-scatters the
  outputs. The backward moves the same bytes again.

The all-to-all runs at the ep group's bandwidth: NVLink for the peers inside the node, each GPU's own
network adapter for the rest (the share of peers outside the node).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.planning.comm_volume import group_bandwidth, ring_share
from megatron.planning.compute_cost import Calibration, PassTime, gemm_seconds, layer_time, linear_seconds
from megatron.planning.hardware import Hardware
from megatron.planning.kernels import dtype_bytes
from megatron.planning.moe_routing import imbalance_load, routes_per_expert
from megatron.planning.parameters import expert_parameters


@dataclass(frozen=True)
class ExpertRows:
    """How many rows the busiest expert-parallel rank's experts run, per microbatch."""

    routed_tokens: int  # tokens this rank routes (its share of the sequence under sequence parallelism)
    local_experts: int
    rows: int  # rows each local expert runs
    load: float  # over the balanced load


def expert_rows(config, tokens: int, tp: int, ep: int, etp: int) -> ExpertRows:
    """The rows of each local expert on the busiest rank, `tokens` per tensor-parallel group: under
    sequence parallelism each rank routes its tokens / tp, and an expert shard receives from the ep x etp
    ranks (the etp gather); without it every tp rank routes all tokens, the same on each."""
    routed = tokens // tp if config.sequence_parallel else tokens
    sources = ep * (etp if config.sequence_parallel else 1)
    load = imbalance_load(config) or 1.0
    return ExpertRows(routed, config.num_moe_experts // ep, sources * routes_per_expert(config, routed, load), load)


def grouped_gemm_seconds(rows: int, n: int, k: int, config, hw: Hardware, cal: Calibration) -> tuple[float, float]:
    """(forward, backward) of one expert's [rows, k] x [k, n] linear inside a grouped GEMM: the dense linear's
    (`linear_seconds`: FP8 under --fp8-format) x (rows + r0) / rows."""
    if rows == 0:
        return 0.0, 0.0
    forward, backward = linear_seconds(rows, n, k, config, hw, cal)
    return forward * (rows + cal.expert_rows_half) / rows, backward * (rows + cal.expert_rows_half) / rows


def moe_part_time(
    config, tokens: int, tp: int, ep: int, etp: int, hw: Hardware, cal: Calibration
) -> tuple[PassTime, PassTime]:
    """(forward, backward) of the router, experts, shared expert and permutation of one MoE layer
    (the backward: twice the GEMMs and elementwise bytes, as the dense layer's; under FP8 the experts' and the
    shared expert's GEMMs are FP8 linears, `linear_seconds`, the router stays BF16)."""
    h, e = config.hidden_size, dtype_bytes(config.params_dtype)
    mats = 2 if config.swiglu else 1
    f = config.moe_ffn_hidden_size // etp
    work = expert_rows(config, tokens, tp, ep, etp)
    expert_in = grouped_gemm_seconds(work.rows, mats * f, h, config, hw, cal)
    expert_out = grouped_gemm_seconds(work.rows, h, f, config, hw, cal)
    router = gemm_seconds(work.routed_tokens, config.num_moe_experts, h, e, hw, cal)  # the router stays BF16
    shared = config.moe_shared_expert_intermediate_size or 0
    shared_in, shared_out = (
        (
            linear_seconds(tokens, mats * shared // tp, h, config, hw, cal),
            linear_seconds(tokens, h, shared // tp, config, hw, cal),
        )
        if shared
        else ((0.0, 0.0), (0.0, 0.0))
    )
    gemm_f, gemm_b = (
        router * scale + work.local_experts * (expert_in[i] + expert_out[i]) + (shared_in[i] + shared_out[i])
        for i, scale in ((0, 1), (1, 2))
    )
    activation = (mats + 1) * e * (work.local_experts * work.rows * f + tokens * shared // tp)
    permute = 2 * 2 * work.routed_tokens * config.moe_router_topk * h * e  # into expert order and back
    elementwise = (activation + permute) / (hw.hbm_gbps * 1e9 * cal.hbm_efficiency)
    return PassTime(gemm=gemm_f, elementwise=elementwise), PassTime(gemm=gemm_b, elementwise=2 * elementwise)


def all_to_all_seconds(volume: float, size: int, stride: int, hw: Hardware, cal: Calibration) -> float:
    """An all-to-all of which this rank sends `volume` bytes to the other size - 1 ranks (`stride` apart)
    in equal parts: NVLink to the peers in its node, its network adapter to the others."""
    if size == 1:
        return 0.0
    in_node = max(1, min(size, hw.gpus_per_node // stride))
    outside = (size - in_node) / (size - 1)
    return (
        volume
        * ((1 - outside) / (hw.intra_node_gbps * 1e9) + outside / (hw.inter_node_gbps * 1e9))
        / cal.comm_efficiency
    )


def dispatch_seconds(config, tokens: int, tp: int, ep: int, etp: int, hw: Hardware, cal: Calibration) -> float:
    """One pass's token dispatch and combine of one MoE layer (the backward moves as much)."""
    h, e = config.hidden_size, dtype_bytes(config.params_dtype)
    work = expert_rows(config, tokens, tp, ep, etp)
    gather = etp if config.sequence_parallel else 1  # without it every etp rank holds every token
    if config.moe_token_dispatcher_type == "allgather":
        group = ep * gather
        gathered = ring_share(group) * group * work.routed_tokens * h * e if group > 1 else 0.0
        return 2 * gathered / (group_bandwidth(hw, group, 1) * cal.comm_efficiency) if gathered else 0.0
    copies = work.routed_tokens * config.moe_router_topk * h * e * work.load
    seconds = 2 * all_to_all_seconds(ring_share(ep) * copies, ep, etp, hw, cal)
    if gather > 1:  # the received rows gathered over etp, the outputs reduce-scattered
        rows = work.local_experts * work.rows * h * e
        seconds += 2 * ring_share(gather) * rows / (group_bandwidth(hw, gather, 1) * cal.comm_efficiency)
    return seconds


def moe_layers(config) -> int:
    """How many of the model's layers are MoE layers (--moe-layer-freq)."""
    return sum(config.is_moe_layer(i) for i in range(config.num_layers))


def moe_layer_average(config, layout, kernel: str, dense: tuple[PassTime, PassTime], tp_layer: float, hw, cal):
    """(forward, backward, tensor-parallel seconds, dispatch seconds) of the model's average layer: its
    MoE layers (the attention part, `moe_part_time`, the dispatch; under sequence parallelism the
    expert rows' etp gather replaces the MLP's two tp collectives) and dense layers by their share."""
    par = layout.parallel
    tokens = layout.micro_batch_size * config.seq_length // par.cp
    share = moe_layers(config) / config.num_layers
    attn_f, attn_b = layer_time(config, kernel, layout.micro_batch_size, par.cp, par.tp, hw, cal, mlp=False)
    etp = par.dims.etp
    moe_f, moe_b = moe_part_time(config, tokens, par.tp, par.ep, etp, hw, cal)
    forward = dense[0].scaled(1 - share) + (attn_f + moe_f).scaled(share)
    backward = dense[1].scaled(1 - share) + (attn_b + moe_b).scaled(share)
    moe_tp = tp_layer / 2 if config.sequence_parallel else tp_layer
    tp_s = tp_layer * (1 - share) + moe_tp * share
    return forward, backward, tp_s, share * dispatch_seconds(config, tokens, par.tp, par.ep, etp, hw, cal)


def expert_parameters_per_layer(config) -> float:
    """The routed experts' parameters of the whole model per layer (0 for a dense model)."""
    return expert_parameters(config) / config.num_layers if config.num_moe_experts is not None else 0.0
