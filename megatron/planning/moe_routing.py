"""What the memory estimate assumes of MoE routing, which decides how many rows each expert runs.

Dropless routing sends each expert the tokens the router picks: data, unknown before the run. The
dispatchers read that data in one place (`token_dispatcher.host_counts`: routes per source rank and
expert), and the trace (trace.py) stands in `routes_per_expert` for every entry there
(`stand_in_routing`), so the MoE layers run at their real per-rank shapes on fake tensors:

- dropless: the **balanced load**, ceil(T k / E) routes from each routing rank's T tokens to each of
  the E experts (its T k routes spread evenly);
- with --moe-expert-capacity-factor: at most the capacity ceil(T k / E x factor);
- with --moe-pad-expert-input-to-capacity: exactly the capacity (padding makes every expert's rows the
  capacity whatever the routing, so there this is no assumption and the estimate is exact);
- grouped experts under the allgather dispatcher: no read at all; the rows are a fixed bound
  (token_dispatcher.allgather_row_bound) whatever the routing, so the estimate is exact there too.

Training routes unevenly. The allowance "MoE routing imbalance" is what a rank's saved activations grow
by when each of its experts gets `imbalance_load` x the balanced load: the capacity factor when one is
given (no expert takes more), else DEFAULT_IMBALANCE; none with padding.
"""

from __future__ import annotations

import contextlib
import math

from megatron.core.transformer.moe import token_dispatcher
from megatron.core.transformer.moe.routing import expert_capacity

# the busiest expert's load over the mean allowed for dropless routing: tools/bench/moe.py measured 1.29-1.45 at
# initialisation (docs/moe.md); an assumption for training, not a measurement of it
DEFAULT_IMBALANCE = 1.5


def routes_per_expert(config, tokens: int, load: float = 1.0) -> int:
    """Routes of one routing rank's `tokens` tokens to each expert at `load` x the balanced load."""
    topk, experts, factor = config.moe_router_topk, config.num_moe_experts, config.moe_expert_capacity_factor
    routes = math.ceil(tokens * topk * load / experts)
    if factor is not None:
        capacity = expert_capacity(tokens * topk, experts, factor)
        routes = capacity if config.moe_pad_expert_input_to_capacity else min(routes, capacity)
    return min(routes, tokens)  # a token routes to an expert at most once


def fixed_rows(config) -> bool:
    """Whether an MoE layer's shapes do not depend on the routing: experts padded to their capacity, or grouped
    experts under the allgather dispatcher (a fixed row bound)."""
    grouped_allgather = config.moe_grouped_gemm and config.moe_token_dispatcher_type == "allgather"
    return config.moe_pad_expert_input_to_capacity or grouped_allgather


def imbalance_load(config) -> float | None:
    """The load the "MoE routing imbalance" allowance assumes; None where routing decides no shape (a dense
    model, experts padded to their capacity, grouped experts under allgather)."""
    if config.num_moe_experts is None or fixed_rows(config):
        return None
    return config.moe_expert_capacity_factor or DEFAULT_IMBALANCE


def imbalance_label(config) -> str:
    """The allowance's name, with the assumption it makes."""
    factor = config.moe_expert_capacity_factor
    if factor:
        return f"MoE routing imbalance (each expert at its capacity, --moe-expert-capacity-factor {factor:g})"
    return f"MoE routing imbalance (each expert at {DEFAULT_IMBALANCE:g}x the balanced load, assumed: dropless)"


def describe(config) -> str | None:
    """One line on what the estimate assumes of the routing (None for a dense model)."""
    if config.num_moe_experts is None:
        return None
    if config.moe_pad_expert_input_to_capacity:
        return "> MoE: every expert's rows are its capacity (padded): exact, whatever the routing"
    if fixed_rows(config):
        return (
            "> MoE: grouped experts under allgather run a fixed bound of rows (no host sync): exact, whatever the "
            "routing"
        )
    return (
        "> MoE: saved activations at the balanced load (each expert gets ceil(T x topk / experts) routes of every "
        "rank's T tokens"
        + (", at most its capacity" if config.moe_expert_capacity_factor else "")
        + f"); uneven routing is the allowance {imbalance_label(config)}"
    )


@contextlib.contextmanager
def stand_in_routing(config, tokens: int, load: float):
    """Within: the dispatchers read `routes_per_expert(config, tokens, load)` for every (source rank, expert)."""
    routes = routes_per_expert(config, tokens, load) if config.num_moe_experts is not None else 0
    original = token_dispatcher.host_counts
    token_dispatcher.host_counts = lambda counts: [[routes] * counts.shape[1] for _ in range(counts.shape[0])]
    try:
        yield
    finally:
        token_dispatcher.host_counts = original
