"""Where the auto policy puts each chunk's parts (megatron/core/distributed/placement.py): the
parts that move the most bytes per device byte stay on the device first, and a host budget is
met before the device room is filled."""

from __future__ import annotations

import pytest

from megatron.core.distributed.placement import Placement, auto_placement, host_elements, part_bytes, static_placement

NUMELS = [1000] * 4
ORDER = [3, 2, 1, 0]  # the forward uses chunk 3 first
COSTS = part_bytes(2, shards_grads=True, shards_params=True)  # bf16 under optim_grads_params: 12 / 4 / 2 per element


def decide(room: int | None, host_budget: int | None = None):
    budget = None if room is None else int(room / 0.9) + 1  # room = budget - margin (fixed 0)
    return auto_placement(ORDER, NUMELS, COSTS, budget, 0, 2, host_budget)


def test_parameters_then_gradients_then_optimizer_state_come_back():
    everything = decide(None).placement
    assert everything == Placement()
    assert decide(0).placement == Placement(*(frozenset(ORDER),) * 3)
    two_params = decide(2 * 2000).placement  # room for two chunks' parameters: the first the forward uses
    assert two_params.params == {1, 0} and two_params.grads == two_params.optimizer == set(ORDER)
    grads = decide(4 * 2000 + 4000 * 2).placement  # every parameter, two gradients
    assert grads.params == set() and grads.grads == {1, 0} and grads.optimizer == set(ORDER)
    assert decide(4 * 18000).placement == Placement()


def test_a_host_budget_brings_parameters_then_whole_chunks_back():
    full_host = 4 * host_elements(NUMELS, Placement(*(frozenset(ORDER),) * 3), 2)
    assert full_host == 4 * 16000 + 4 * 2000 + 2 * 4000
    decision = decide(4 * 18000, host_budget=full_host - 1)  # too little host for every parameter there
    assert decision.fits and decision.host_bytes < full_host
    tight = decide(2 * 18000 + 2 * 2000, host_budget=2 * 16000 + 2 * 4000)  # host for two chunks' state only
    assert tight.fits and tight.placement.params == set() and tight.placement.optimizer == {1, 0}
    assert tight.placement.grads == {1, 0}, "a gradient on the device would cost device bytes for no host saving"
    assert not decide(1000, host_budget=1000).fits


def test_static_fractions_nest():
    placement = static_placement(ORDER, NUMELS, 1.0, 0.5, 0.25)
    assert placement.params == {0} and placement.grads == {1, 0} and placement.optimizer == set(ORDER)
    with pytest.raises(ValueError, match="must nest"):
        Placement(frozenset({0}), frozenset(), frozenset({0}))
