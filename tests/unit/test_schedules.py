"""Pipeline schedules as data: coverage, p2p matching, deadlock freedom, bubble, in-flight activations."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron.core.pipeline_parallel.placement import Placement
from megatron.core.pipeline_parallel.schedules import (
    Action,
    ActionKind,
    build_schedule,
    interleaved_order,
    num_warmup_microbatches,
    peer_rank,
)
from megatron.planning.pipeline_simulator import (
    ScheduleError,
    analytic_bubble_fraction,
    bubble_fraction,
    peak_in_flight,
    simulate,
    simulate_steps,
)

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
SF, RF, SB, RB = ActionKind.SEND_FORWARD, ActionKind.RECV_FORWARD, ActionKind.SEND_BACKWARD, ActionKind.RECV_BACKWARD
GRID = [(p, v, m) for p in (2, 4, 8) for v in (1, 2, 4) for m in (p, 2 * p, 4 * p)]
# Interleaved with microbatch groups larger than p, and with a last group of m % g >= p microbatches.
GROUPED = [(4, 2, 16, 8), (4, 2, 10, 5), (4, 4, 12, 8), (2, 2, 5, 3), (2, 3, 7, 5), (8, 2, 20, 12)]
REPO = Path(__file__).resolve().parents[2]


def schedules(p, v, m, group_size=None):
    return [build_schedule(p, v, m, r, group_size=group_size) for r in range(p)]


def stage(p, rank, chunk):
    return chunk * p + rank


def check_coverage(steps, p, v, m, rank):
    """Every (microbatch, chunk) forwarded once, then backwarded once; transfers exactly where a stage has a peer."""
    assert all(len(s) == 1 for s in steps if s[0].kind.is_compute), "a compute step holds one action"
    assert all(s and not any(a.kind.is_compute for a in s) for s in steps if not s[0].kind.is_compute)
    actions = [a for s in steps for a in s]
    units = {(mb, c) for mb in range(m) for c in range(v)}
    position = {}
    for i, a in enumerate(actions):
        key = (a.kind, a.microbatch, a.chunk)
        assert key not in position, f"{a} appears twice on rank {rank}"
        position[key] = i
    for kind in (F, B):
        assert {(a.microbatch, a.chunk) for a in actions if a.kind is kind} == units
    for mb, c in units:
        assert position[(F, mb, c)] < position[(B, mb, c)]
    last = p * v - 1
    expected = {
        SF: {u for u in units if stage(p, rank, u[1]) != last},
        RB: {u for u in units if stage(p, rank, u[1]) != last},
        RF: {u for u in units if stage(p, rank, u[1]) != 0},
        SB: {u for u in units if stage(p, rank, u[1]) != 0},
    }
    for kind, wanted in expected.items():
        assert {(a.microbatch, a.chunk) for a in actions if a.kind is kind} == wanted, kind


@pytest.mark.parametrize("p,v,m", GRID)
def test_every_unit_forwarded_and_backwarded_once(p, v, m):
    for rank, steps in enumerate(schedules(p, v, m)):
        check_coverage(steps, p, v, m, rank)


def messages(steps, p, v, rank, sending):
    """Per peer rank: (is forward, microbatch, sender's stage) of each message sent or received, in posting order."""
    per_peer = {}
    for step in steps:
        for a in step:
            if a.kind.is_compute or (a.kind in (SF, SB)) != sending:
                continue
            forward = a.kind in (SF, RF)
            own = stage(p, rank, a.chunk)
            sender_stage = own if sending else (own - 1 if forward else own + 1)
            per_peer.setdefault(peer_rank(a, rank, Placement(p, v)), []).append((forward, a.microbatch, sender_stage))
    return per_peer


@pytest.mark.parametrize("p,v,m", GRID)
def test_sends_and_receives_pair_up_in_order(p, v, m):
    """Between each pair of ranks the receiver posts the sender's messages in the sender's order, across
    directions too (p == 2 has forward and backward messages on one pair), so order-only matching works."""
    lists = schedules(p, v, m)
    sent = [messages(s, p, v, r, sending=True) for r, s in enumerate(lists)]
    received = [messages(s, p, v, r, sending=False) for r, s in enumerate(lists)]
    for src in range(p):
        for dst in range(p):
            assert sent[src].get(dst, []) == received[dst].get(src, []), (src, dst)


@pytest.mark.parametrize("times", [(1.0, 1.0), (1.0, 2.0)])
@pytest.mark.parametrize("p,v,m", GRID)
def test_simulated_bubble_equals_megatron_formula(p, v, m, times):
    timeline = simulate(p, v, m, forward_time=times[0], backward_time=times[1])  # raises on deadlock or mismatch
    expected = (p - 1) / m if v == 1 else (p - 1) / (v * m)
    assert analytic_bubble_fraction(p, v, m) == pytest.approx(expected, rel=1e-12)
    assert bubble_fraction(timeline) == pytest.approx([expected] * p, rel=1e-12)
    busy = m * v * (times[0] + times[1])
    assert timeline.makespan == pytest.approx(busy * (1 + expected), rel=1e-12)


@pytest.mark.parametrize("p,v,m", GRID)
def test_in_flight_activations_follow_warmup(p, v, m):
    for rank, steps in enumerate(schedules(p, v, m)):
        if v == 1:
            warmup = min(p - rank - 1, m)
        else:
            warmup = min(2 * (p - rank - 1) + (v - 1) * p, v * m)
        assert num_warmup_microbatches(p, v, m, rank) == warmup
        # The first steady-state forward runs before the first backward: one more than the warm-up.
        assert peak_in_flight(steps) == min(warmup + 1, v * m), rank


@pytest.mark.parametrize("p,v,m,g", GROUPED)
def test_group_size_larger_than_p_and_short_last_group(p, v, m, g):
    lists = schedules(p, v, m, group_size=g)
    for rank, steps in enumerate(lists):
        check_coverage(steps, p, v, m, rank)
        assert peak_in_flight(steps) == min(2 * (p - rank - 1) + (v - 1) * g + 1, v * m)
    timeline = simulate(p, v, m, group_size=g, forward_time=1.0, backward_time=1.0)
    assert bubble_fraction(timeline) == pytest.approx([(p - 1) / (v * m)] * p, rel=1e-12)


def test_interleaved_order_matches_megatron_table():
    # Megatron's get_schedule_table example: PP2, group 3, 5 microbatches, 2 chunks.
    expected = [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    assert interleaved_order(5, 2, 3) == expected


def test_no_pipelining_is_plain_gradient_accumulation():
    steps = build_schedule(1, 1, 3, 0)
    assert steps == [[Action(k, mb, 0)] for mb in range(3) for k in (F, B)]
    assert build_schedule(1, 1, 3, 0, kind="1f1b") == steps == build_schedule(1, 1, 3, 0, kind="none")
    assert bubble_fraction(simulate(1, 1, 3)) == [0.0]


def test_1f1b_steps_for_two_ranks():
    """The exact lists for p=2, m=3, showing Megatron's batching: forward output with the next gradient's receive."""
    a = Action
    assert build_schedule(2, 1, 3, 0) == [
        [a(F, 0, 0)],
        [a(SF, 0, 0)],  # warm-up
        [a(F, 1, 0)],
        [a(SF, 1, 0), a(RB, 0, 0)],
        [a(B, 0, 0)],
        [a(F, 2, 0)],
        [a(SF, 2, 0), a(RB, 1, 0)],
        [a(B, 1, 0)],
        [a(RB, 2, 0)],
        [a(B, 2, 0)],  # cool-down
    ]
    assert build_schedule(2, 1, 3, 1) == [
        [a(RF, 0, 0)],
        [a(F, 0, 0)],
        [a(B, 0, 0)],
        [a(RF, 1, 0), a(SB, 0, 0)],
        [a(F, 1, 0)],
        [a(B, 1, 0)],
        [a(RF, 2, 0), a(SB, 1, 0)],
        [a(F, 2, 0)],
        [a(B, 2, 0)],
        [a(SB, 2, 0)],
    ]
    timeline = simulate(2, 1, 3, forward_time=1.0, backward_time=2.0)
    assert [(e.start, e.end) for e in timeline.events[1]] == [(1, 2), (2, 4), (4, 5), (5, 7), (7, 8), (8, 10)]
    assert timeline.makespan == 12  # (m + p - 1) * (f + b)


def test_simulator_reports_deadlock():
    a = Action
    rank0 = [[a(F, 0, 0)], [a(RB, 0, 0)], [a(SF, 0, 0)], [a(B, 0, 0)]]  # the send queues behind the receive
    rank1 = [[a(RF, 0, 0)], [a(F, 0, 0)], [a(B, 0, 0)], [a(SB, 0, 0)]]
    message = (
        r"^deadlock: rank 0 at step 3 \[BACKWARD\(mb=0, chunk=0\)\] waiting for step 1 \[RECV_BACKWARD.*; "
        r"rank 1 at step 1 \[FORWARD\(mb=0, chunk=0\)\] waiting for step 0 \[RECV_FORWARD"
    )
    with pytest.raises(ScheduleError, match=message):
        simulate_steps([rank0, rank1], v=1)


def test_posted_receive_overlaps_computation():
    """A receive posted ahead is waited for only by its consumer: rank 1 posts both inputs first and
    runs F1 as soon as its input has arrived, not when it posted the receive."""
    a = Action
    rank0 = [
        [a(F, 0, 0)],
        [a(SF, 0, 0)],
        [a(F, 1, 0)],
        [a(SF, 1, 0), a(RB, 0, 0)],
        [a(B, 0, 0)],
        [a(RB, 1, 0)],
        [a(B, 1, 0)],
    ]
    rank1 = [
        [a(RF, 0, 0)],
        [a(RF, 1, 0)],
        [a(F, 0, 0)],
        [a(B, 0, 0)],
        [a(SB, 0, 0)],
        [a(F, 1, 0)],
        [a(B, 1, 0)],
        [a(SB, 1, 0)],
    ]
    timeline = simulate_steps([rank0, rank1], v=1, forward_time=1.0, backward_time=2.0, transfer_time=0.5)
    # rank 0: F0 0-1, F1 1-2; rank 1: F0 waits for SF0 (1.5), B0 2.5-4.5, F1's input arrived at 2.5
    assert [(e.start, e.end) for e in timeline.events[1]] == [(1.5, 2.5), (2.5, 4.5), (4.5, 5.5), (5.5, 7.5)]
    assert [(e.start, e.end) for e in timeline.events[0]] == [(0, 1), (1, 2), (5, 7), (8, 10)]


def test_a_send_holds_back_the_batches_posted_after_it():
    """NCCL runs a rank's batches in order, so a receive posted early blocks the sends behind it; the
    simulator reports the deadlock that gloo (ops complete one by one) would not show."""
    a = Action
    rank0 = [[a(F, 0, 0)], [a(RB, 0, 0)], [a(SF, 0, 0)], [a(B, 0, 0)]]
    rank1 = [[a(RF, 0, 0)], [a(F, 0, 0)], [a(B, 0, 0)], [a(SB, 0, 0)]]
    with pytest.raises(ScheduleError, match=r"rank 1 at step 1 .* waiting for step 0"):
        simulate_steps([rank0, rank1], v=1)
    rank0[1], rank0[2] = rank0[2], rank0[1]  # the send first: fine
    assert simulate_steps([rank0, rank1], v=1).makespan == 6.0


def _steady_batches_merged(steps):
    """The previous batching, for comparison: [F][SF RF][B][SB RB] -> [F][B][SF RF SB RB]."""
    out, i = [], 0
    while i < len(steps):
        window = steps[i : i + 4]
        if (
            len(window) == 4
            and [s[0].kind for s in window[::2]] == [F, B]
            and not window[1][0].kind.is_compute
            and not window[3][0].kind.is_compute
        ):
            out += [window[0], window[2], window[1] + window[3]]
            i += 4
        else:
            out.append(steps[i])
            i += 1
    return out


@pytest.mark.parametrize("p,v,m", [(p, v, m) for p, v, m in GRID if v > 1])
def test_interleaved_receives_are_posted_a_computation_ahead(p, v, m):
    """In the steady state every receive is posted before a computation that does not need it (the
    transfer overlaps it), so with transfers that take time the interleaved schedule loses less to
    them than the same schedule with one batch per forward-backward pair."""
    for rank, steps in enumerate(schedules(p, v, m)):
        warmup = num_warmup_microbatches(p, v, m, rank)
        computes = [i for i, s in enumerate(steps) if s[0].kind.is_compute]
        steady = computes[warmup : 2 * v * m - warmup]  # F B F B ... between warm-up and cool-down
        for here, after in zip(steady, steady[1:-1]):
            for a in (x for s in steps[here + 1 : after] for x in s if x.kind in (RF, RB)):
                consumer = Action(F if a.kind is RF else B, a.microbatch, a.chunk)
                assert steps[after] != [consumer], (rank, a)
    t = 0.3
    overlapped = simulate(p, v, m, forward_time=1.0, backward_time=2.0, transfer_time=t).makespan
    merged = simulate_steps(
        [_steady_batches_merged(s) for s in schedules(p, v, m)], v, forward_time=1.0, backward_time=2.0, transfer_time=t
    ).makespan
    assert overlapped < merged


def test_overlapped_interleaving_beats_1f1b_when_transfers_take_time():
    """p=2, m=8, a transfer 0.3 of a 1F1B stage's forward: 1F1B 29.7, the interleaved schedule with one
    batch per forward-backward pair 31.2 (slower than 1F1B, as measured on CPU gloo), overlapped 27.3."""
    t = 0.3
    one = simulate(2, 1, 8, forward_time=1.0, backward_time=2.0, transfer_time=t).makespan
    lists = schedules(2, 2, 8)
    merged = simulate_steps(
        [_steady_batches_merged(s) for s in lists], 2, forward_time=0.5, backward_time=1.0, transfer_time=t
    ).makespan
    overlapped = simulate_steps(lists, 2, forward_time=0.5, backward_time=1.0, transfer_time=t).makespan
    assert (one, merged, overlapped) == pytest.approx((29.7, 31.2, 27.3))


W = ActionKind.WEIGHT


@pytest.mark.parametrize("p,v,m", GRID)
def test_split_backward_puts_each_weight_step_right_after_its_input_gradient_is_sent(p, v, m):
    """Without its WEIGHT steps a split list is the plain one; each WEIGHT follows its BACKWARD
    and the transfer step right after it, which sends that backward's input gradient (unless
    the stage is the first)."""
    for rank in range(p):
        plain, split = build_schedule(p, v, m, rank), build_schedule(p, v, m, rank, split_backward=True)
        assert [step for step in split if step[0].kind is not W] == plain
        for i, step in enumerate(split):
            if step[0].kind is not B:
                continue
            unit = (step[0].microbatch, step[0].chunk)
            after = split[i + 1] if split[i + 1][0].kind is W else split[i + 2]
            assert after == [Action(W, *unit)], (rank, i)
            if stage(p, rank, unit[1]) != 0:
                assert Action(SB, *unit) in split[i + 1], (rank, i)


@pytest.mark.parametrize("p,v,m", GRID)
def test_split_backward_runs_without_deadlock_and_never_slower(p, v, m):
    """At F = 1, B = 2 (input and weight gradients 1 each) per 1F1B stage, splitting saves exactly
    (p - 1) weight-gradient times for 1F1B (the cool-down's chain of backwards runs on input
    gradients); it is never slower, and with transfers that take time it saves more."""
    times = dict(forward_time=1.0 / v, backward_time=2.0 / v)
    for t in (0.0, 0.3):
        plain = simulate(p, v, m, transfer_time=t, **times).makespan
        split = simulate(p, v, m, transfer_time=t, split_backward=True, **times).makespan
        assert split <= plain + 1e-9
        if v == 1 and t == 0.0:
            assert split == pytest.approx(plain - (p - 1) * 1.0)
        if t > 0:
            assert split < plain


def test_simulator_reports_weight_step_before_its_backward():
    steps = [[Action(F, 0, 0)], [Action(W, 0, 0)], [Action(B, 0, 0)]]
    with pytest.raises(ScheduleError, match=r"WEIGHT\(mb=0, chunk=0\): runs before its backward"):
        simulate_steps([steps], v=1)


def test_simulator_reports_messages_out_of_order():
    lists = schedules(2, 1, 3)
    recvs = [(i, j) for i, step in enumerate(lists[1]) for j, act in enumerate(step) if act.kind is RF]
    (i0, j0), (i1, j1) = recvs[:2]
    lists[1][i0][j0], lists[1][i1][j1] = Action(RF, 1, 0), Action(RF, 0, 0)
    message = r"p2p mismatch rank 0 -> 1: .*SEND_FORWARD\(mb=0, chunk=0\) met .*RECV_FORWARD\(mb=1"
    with pytest.raises(ScheduleError, match=message):
        simulate_steps(lists, v=1)


def test_simulator_reports_forward_without_input():
    lists = schedules(2, 1, 2)
    lists[1] = [s for s in lists[1] if s != [Action(RF, 0, 0)]]  # drop the first receive
    with pytest.raises(ScheduleError, match=r"FORWARD\(mb=0, chunk=0\): its input has not been received"):
        simulate_steps(lists, v=1)


@pytest.mark.parametrize(
    "steps,message",
    [
        ([[(F, 0)], [(F, 0)], [(B, 0)]], r"rank 0 step 1 FORWARD\(mb=0, chunk=0\): runs twice"),
        ([[(B, 0)], [(F, 0)]], r"BACKWARD\(mb=0, chunk=0\): runs before its forward"),
        ([[(F, 0)], [(SF, 0)], [(B, 0)]], r"SEND_FORWARD\(mb=0, chunk=0\): the last stage has no next stage"),
        ([[(F, 0), (B, 0)]], r"mixes a computation"),
    ],
)
def test_simulator_rejects_inconsistent_single_rank_lists(steps, message):
    lists = [[[Action(kind, mb, 0) for kind, mb in step] for step in steps]]
    with pytest.raises(ScheduleError, match=message):
        simulate_steps(lists, v=1)


@pytest.mark.parametrize(
    "args,kwargs,message",
    [
        ((0, 1, 4, 0), {}, r"p \(pipeline-model-parallel size\) must be a positive integer, got 0"),
        ((2, 1, 0, 0), {}, r"m \(microbatches\) must be a positive integer"),
        ((2, 1, 4, 2), {}, r"pipeline rank must be in \[0, 2\), got 2"),
        ((2, 1, 4, 0), {"kind": "gpipe"}, r"unknown schedule kind 'gpipe'"),
        ((2, 1, 4, 0), {"kind": "none"}, r"'none' \(no pipelining\) needs p == 1"),
        ((2, 2, 4, 0), {"kind": "1f1b"}, r"'1f1b' runs one model chunk per rank, got v=2"),
        ((2, 1, 4, 0), {"kind": "interleaved"}, r"needs v >= 2"),
        ((1, 2, 4, 0), {}, r"need --pipeline-model-parallel-size >= 2"),
        ((4, 2, 3, 0), {}, r"at least as many microbatches as pipeline stages: got 3 .*--global-batch-size"),
        ((4, 2, 8, 0), {"group_size": 3}, r"--microbatch-group-size-per-virtual-pipeline-stage must be in \[4, 8\]"),
        ((4, 2, 8, 0), {"group_size": 9}, r"must be in \[4, 8\]"),
        ((4, 1, 8, 0), {"group_size": 4}, r"only applies to the interleaved schedule"),
    ],
)
def test_bad_arguments_raise_one_line_value_errors(args, kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        build_schedule(*args, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("p,m,g", [(4, 6, None), (4, 10, None), (2, 5, None), (4, 13, 6)])
def test_last_microbatch_group_smaller_than_p_is_refused(p, m, g):
    """A last group of 0 < m % g < p microbatches would leave rank 0 waiting for a chunk input that
    cannot arrive in time (Megatron refuses it too); m % g == 0 or >= p is supported (see GROUPED)."""
    with pytest.raises(ValueError, match=r"leave a last group of \d < \d .*--global-batch-size") as info:
        build_schedule(p, 2, m, 0, group_size=g)
    assert "--microbatch-group-size-per-virtual-pipeline-stage" in str(info.value)


def run_tool(*flags):
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "plot_pipeline_schedule.py"), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_plot_tool_prints_bubble_and_rejects_bad_flags(tmp_path):
    result = run_tool("--pp", "4", "--vpp", "2", "--microbatches", "8")
    assert result.returncode == 0, result.stderr
    assert "simulated 0.1875" in result.stdout and "analytic (p-1)/(v*m) 0.1875" in result.stdout
    for flags in (["--pp", "0", "--microbatches", "8"], ["--pp", "4", "--vpp", "2", "--microbatches", "6"]):
        bad = run_tool(*flags)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr
        assert bad.stderr.strip().splitlines()[-1].startswith("plot_pipeline_schedule.py: error: ")
    pytest.importorskip("matplotlib")
    out = tmp_path / "schedule.png"
    drawn = run_tool("--pp", "2", "--vpp", "2", "--microbatches", "4", "-o", str(out))
    assert drawn.returncode == 0, drawn.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
