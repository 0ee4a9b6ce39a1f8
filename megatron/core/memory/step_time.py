"""An analytic iteration-time model, used only to *rank* layouts that fit in memory.

Per microbatch and model chunk: model FLOPs (as megatron/training/flops.py counts
them: forward 2 FLOPs per multiply-accumulate, backward twice the forward, plus
the recomputed forward) at `peak_tflops x matmul_efficiency`, divided by tp x cp;
tensor-parallel collectives (4 all-reduce equivalents of [s, b, h] per layer,
forward + backward; an all-reduce moves 2 (t-1)/t of its bytes), the context-
parallel k/v ring ((c-1)/c of the full k and v, forward; twice that, backward) and
the p2p send, none of them overlapped with compute. The pipeline is our own
schedule run by the simulator (megatron/core/pipeline_parallel/simulate.py) with
those chunk times, so the bubble is the schedule's, not (p-1)/(v m). Then the
data-parallel gradient all-reduce (not overlapped: pessimistic) and the optimizer
step (memory-bound). Bandwidths are per GPU; a group stays on NVLink while it
fits in a node (tp fastest, then cp, dp, pp, as the mesh orders ranks).

The constants in `Hardware` are assumptions for ranking (defaults: H100 SXM,
8 per node, 200 Gb/s InfiniBand per GPU), not measurements.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from megatron.core.memory.inflight import equivalent_microbatches
from megatron.core.memory.kernels import dtype_bytes
from megatron.core.memory.parameters import padded_vocab, total_parameters
from megatron.core.pipeline_parallel.layer_split import layers_per_rank as layer_counts
from megatron.core.pipeline_parallel.simulate import simulate


@dataclass(frozen=True)
class Hardware:
    peak_tflops: float = 989.0
    matmul_efficiency: float = 0.5
    intra_node_gbps: float = 300.0
    inter_node_gbps: float = 25.0
    hbm_gbps: float = 2500.0
    gpus_per_node: int = 8


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    tp_comm_s: float
    cp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    dp_comm_s: float
    optimizer_s: float

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.tp_comm_s + self.cp_comm_s + self.pp_comm_s + self.bubble_s
                + self.dp_comm_s + self.optimizer_s)

    @property
    def bubble_fraction(self) -> float:
        busy = self.compute_s + self.tp_comm_s + self.cp_comm_s + self.pp_comm_s
        return self.bubble_s / busy if busy else 0.0


@functools.lru_cache(maxsize=1024)
def bubble_units(p: int, v: int, m: int, group_size: int | None) -> float:
    """Idle time per rank of our schedule, in units of one chunk's forward + backward time:
    the simulated makespan minus the busy time, with forward 1 and backward 2.

    For these schedules the idle time is proportional to (forward + backward) and
    stops growing with m beyond a few p microbatches (both checked in
    tests/unit/test_memory_planner.py), so the simulator runs once per (p, v, m)
    with `equivalent_microbatches` (min(m, 4p + m mod p)), which keeps planning fast.
    """
    m_sim = equivalent_microbatches(p, m, group_size)
    timeline = simulate(p, v, m_sim, group_size=group_size, forward_time=1.0, backward_time=2.0)
    return (timeline.makespan - v * m_sim * 3.0) / 3.0


def _bandwidth(hw: Hardware, span: int) -> float:
    """Bytes/s for a group whose ranks span `span` consecutive global ranks."""
    return 1e9 * (hw.intra_node_gbps if span <= hw.gpus_per_node else hw.inter_node_gbps)


def layer_forward_flops(config, tokens: int, seq: int) -> float:
    h, d, a, g, f = (config.hidden_size, config.kv_channels, config.num_attention_heads, config.num_query_groups,
                     config.ffn_hidden_size)
    mats = h * (a + 2 * g) * d + a * d * h + (3 if config.swiglu else 2) * h * f
    return 2.0 * tokens * (mats + 2 * seq * a * d)


def _recompute_forward_flops(config, tokens: int, seq: int, layers: int) -> float:
    if config.recompute_granularity == "selective":
        return layers * 4.0 * tokens * seq * config.num_attention_heads * config.kv_channels
    if config.recompute_granularity == "full":
        n = layers if config.recompute_method == "uniform" else min(config.recompute_num_layers, layers)
        return n * layer_forward_flops(config, tokens, seq)
    return 0.0


def step_time(config, layout, hw: Hardware = Hardware()) -> StepTime:
    tp, cp, pp, dp, v, m = layout.tp, layout.cp, layout.pp, layout.dp, layout.virtual_stages, layout.num_microbatches
    p_bytes = dtype_bytes(config.params_dtype)
    seq, b, h = config.seq_length, layout.micro_batch_size, config.hidden_size
    tokens = b * seq
    flops_rate = hw.peak_tflops * 1e12 * hw.matmul_efficiency
    # the rank with the most layers sets the pace (--decoder-first/last-pipeline-num-layers)
    layers_per_rank = max(layer_counts(config.num_layers, pp, layout.first_stage_layers, layout.last_stage_layers))
    logits = 2.0 * tokens * h * padded_vocab(config, tp)
    forward = (layers_per_rank * layer_forward_flops(config, tokens, seq) + logits) / (tp * cp)
    recompute = _recompute_forward_flops(config, tokens, seq, layers_per_rank) / (tp * cp)
    t_fwd_compute = forward / v / flops_rate
    t_bwd_compute = (2 * forward + recompute) / v / flops_rate
    activation = tokens // cp * h * p_bytes
    tp_layer = 2 * (tp - 1) / tp * activation / _bandwidth(hw, tp) if tp > 1 else 0.0
    kv = 2 * tokens * config.num_query_groups * config.kv_channels * p_bytes / tp
    cp_layer = (cp - 1) / cp * kv / _bandwidth(hw, tp * cp) if cp > 1 else 0.0
    layers_per_chunk = layers_per_rank / v
    p2p = activation / (tp if config.sequence_parallel else 1) / _bandwidth(hw, layout.world_size) if pp > 1 else 0.0
    t_f = t_fwd_compute + layers_per_chunk * (2 * tp_layer + cp_layer) + p2p
    t_b = t_bwd_compute + layers_per_chunk * (2 * tp_layer + 2 * cp_layer) + p2p
    bubble = (t_f + t_b) * bubble_units(pp, v, m, layout.microbatch_group_size)
    params_rank = total_parameters(config, tp) / (tp * pp)  # average per rank: enough for communication time
    d = dp * cp
    if layout.distributed_optimizer:  # per microbatch with sharded gradients; parameters gathered around use
        grads = layout.grad_dtype_bytes * (m if layout.shards_grads else 1)
        gathers = (2 * m if layout.reshards_params else 1) if layout.shards_params else 1
        dp_bytes = (d - 1) / d * params_rank * (grads + gathers * p_bytes)
    else:
        dp_bytes = 2 * (d - 1) / d * params_rank * layout.grad_dtype_bytes
    dp_comm = dp_bytes / _bandwidth(hw, tp * cp * dp) if d > 1 else 0.0
    shard = params_rank / (d if layout.distributed_optimizer else 1)
    optimizer = shard * 2 * (layout.grad_dtype_bytes + 12 + p_bytes) / (hw.hbm_gbps * 1e9)
    return StepTime(
        compute_s=v * m * (t_fwd_compute + t_bwd_compute),
        tp_comm_s=v * m * layers_per_chunk * 4 * tp_layer, cp_comm_s=v * m * layers_per_chunk * 3 * cp_layer,
        pp_comm_s=v * m * 2 * p2p, bubble_s=max(bubble, 0.0), dp_comm_s=dp_comm, optimizer_s=optimizer)

