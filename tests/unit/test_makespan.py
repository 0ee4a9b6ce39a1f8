"""The planner's replayed makespans against full simulations."""

import dataclasses
import random

import pytest

from megatron.core.pipeline_parallel.schedules import KINDS
from megatron.planning import step_time
from megatron.planning.makespan import makespan, record
from megatron.planning.pipeline_simulator import simulate
from megatron.planning.planner import Search, plan_fastest
from tests.unit.test_memory_planner import GIB, MODEL

SHAPES = [(1, 1, 3, None), (2, 1, 1, None), (4, 1, 3, None), (4, 1, 9, None), (8, 1, 16, None)]
SHAPES += [(2, 2, 4, None), (4, 2, 8, None), (4, 3, 12, None), (4, 2, 10, 5), (8, 2, 16, None)]


def test_replay_gives_the_simulated_makespan_bit_for_bit():
    """Every schedule kind and shape it runs, durations drawn at random (transfers on and off, the
    weight gradients' share too): the tape's makespan is the simulator's, the same float."""
    draw = random.Random(46)
    checked = set()
    for kind in KINDS:
        for p, v, m, group in SHAPES:
            try:
                tape = record(p, v, m, kind, group)
            except ValueError:  # a shape this kind does not run
                continue
            checked.add(kind)
            for transfer in (0.0, draw.uniform(0.01, 0.6)):
                forward, backward = draw.uniform(0.3, 2.0), draw.uniform(0.5, 4.0)
                weight = draw.uniform(0.05, 0.95) * backward
                timing = dict(forward_time=forward, backward_time=backward, transfer_time=transfer, weight_time=weight)
                full = simulate(p, v, m, kind=kind, group_size=group, **timing).makespan
                assert makespan(p, v, m, kind=kind, group_size=group, **timing) == full, (kind, p, v, m, timing)
                assert tape.makespan(forward, backward, transfer, weight) == full
    assert checked == set(KINDS)


def test_replay_refuses_durations_as_the_simulator_does():
    with pytest.raises(ValueError, match="weight time inside the backward time"):
        makespan(4, 1, 8, kind="zb-h1", backward_time=2.0, weight_time=2.0)
    with pytest.raises(ValueError, match="must be positive"):
        makespan(4, 1, 8, forward_time=0.0)


def test_plan_is_the_one_full_simulations_give(monkeypatch):
    """plan_fastest over the pipelines of 8 CPU ranks (each with and without deferred weight gradients):
    the same layouts, step times and counts when every makespan is simulated in full, not replayed."""
    search = Search(pps=(2, 4, 8), micro_batch_sizes=(1, 2), device_type="cpu")

    def planned():
        step_time._unit_makespan.cache_clear()
        top, counts = plan_fastest(MODEL, 8, 32, 5 * GIB // 2, search=search, top=8)
        return [(c.layout, c.recompute, c.time) for c in top], dataclasses.replace(counts, traces=0)

    replayed = planned()
    monkeypatch.setattr(step_time, "makespan", lambda p, v, m, **timing: simulate(p, v, m, **timing).makespan)
    assert planned() == replayed
    assert {"auto", "interleaved-zb"} <= {layout.parallel.pipeline_schedule for layout, _, _ in replayed[0]}
    step_time._unit_makespan.cache_clear()
