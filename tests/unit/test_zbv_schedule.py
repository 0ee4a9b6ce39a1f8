"""ZB-V (--pipeline-schedule zbv): the V placement, torch's compute order, lists that match up and cannot
deadlock, the bubble against 1F1B, the layer split of the V and one-line refusals."""

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

from megatron.core.pipeline_parallel.forward_only import forward_only_actions
from megatron.core.pipeline_parallel.layer_split import stage_layer_ids
from megatron.core.pipeline_parallel.placement import Placement
from megatron.core.pipeline_parallel.schedules import ActionKind, build_schedule
from megatron.core.pipeline_parallel.zbv import zbv_compute_order
from megatron.planning.pipeline_simulator import bubble_fraction, peak_in_flight, simulate, simulate_steps
from megatron.planning.step_time import least_idle, pipeline_idle
from megatron.training.arguments.parser import LLAMA_DEFAULTS, parse_run_config

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT


def test_v_placement_puts_both_ends_on_rank_0_and_turns_on_the_last_rank():
    v = Placement(4, 2, "v")
    assert [v.stage(r, c) for c in (0, 1) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert all(v.location(v.stage(r, c)) == (r, c) for r in range(4) for c in (0, 1))
    assert v.is_first(0, 0) and v.is_last(0, 1)
    assert v.neighbour(1, 1, +1) == (0, 1)  # chunk 1 sends forward to rank r-1
    assert v.is_local(3, 0, +1) and v.is_local(3, 1, -1) and not v.is_local(2, 0, +1)
    loop = Placement(4, 2)
    assert [loop.stage(r, c) for c in (0, 1) for r in range(4)] == list(range(8))
    with pytest.raises(ValueError, match="exactly 2 model chunks"):
        Placement(4, 3, "v")


def _torch_order(p: int, m: int, rank: int) -> list[tuple]:
    """torch.distributed.pipelining's ZB-V compute order of `rank` (its own list builder, no process group)."""
    state = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    actions = ScheduleZBVZeroBubble._calculate_single_rank_operations(state, rank)
    kinds = {"FORWARD": F, "BACKWARD_INPUT": B, "BACKWARD_WEIGHT": W}
    return [
        (kinds[a.computation_type.name], a.microbatch_index, 0 if a.stage_index == rank else 1)
        for a in actions
        if a is not None
    ]


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (8, 8), (8, 20)])
def test_compute_order_is_torchs(p, m):
    for rank in range(p):
        ours = [(a.kind, a.microbatch, a.chunk) for a in zbv_compute_order(p, m, rank)]
        assert ours == _torch_order(p, m, rank), f"rank {rank}"


@pytest.mark.parametrize("p", range(2, 9))
def test_lists_match_up_and_cannot_deadlock_for_any_microbatch_count(p):
    """The simulator (NCCL's strictest reading) checks every send against its receive, in posting order,
    and that each computation's input was received (or handed over on rank p-1); with transfers that take
    time too. Every unit is computed once, and a chunk's WEIGHT steps stay in microbatch order."""
    for m in sorted({1, p - 1, p, 2 * p - 1, 2 * p, 3 * p + 1} - {0}):
        lists = [build_schedule(p, 2, m, r, kind="zbv") for r in range(p)]
        for transfer in (0.0, 0.3):
            simulate_steps(lists, 2, transfer_time=transfer, placement="v")
        for steps in lists:
            compute = [s[0] for s in steps if s[0].kind.is_compute]
            assert sorted((a.kind.value, a.microbatch, a.chunk) for a in compute) == sorted(
                (k.value, mb, c) for k in (F, B, W) for mb in range(m) for c in (0, 1)
            )
            for chunk in (0, 1):
                weights = [a.microbatch for a in compute if a.kind is W and a.chunk == chunk]
                assert weights == sorted(weights)


def test_the_turn_on_the_last_rank_is_not_a_transfer():
    steps = build_schedule(4, 2, 8, 3, kind="zbv")
    transfers = [a for s in steps for a in s if not a.kind.is_compute]
    kinds = {(a.kind, a.chunk) for a in transfers}
    assert (ActionKind.SEND_FORWARD, 0) not in kinds and (ActionKind.RECV_FORWARD, 1) not in kinds
    assert (ActionKind.SEND_BACKWARD, 1) not in kinds and (ActionKind.RECV_BACKWARD, 0) not in kinds
    assert [a for a in forward_only_actions(Placement(4, 2, "v"), 1, 3)] == [
        ("recv", 0, 0),
        ("forward", 0, 0),
        ("forward", 0, 1),
        ("send", 0, 1),
    ]


def test_bubble_at_p4_m8_is_at_most_a_third_of_1f1b():
    """F = B = W = 1 unit per 1F1B stage, so half a unit per ZB-V chunk (a chunk is half a stage)."""
    one_f_one_b = simulate(4, 1, 8, kind="1f1b", forward_time=1.0, backward_time=2.0)
    zbv = simulate(4, 2, 8, kind="zbv", forward_time=0.5, backward_time=1.0, weight_time=0.5)
    idle_1f1b = one_f_one_b.makespan - 8 * 3
    idle_zbv = zbv.makespan - 8 * 3
    assert idle_1f1b == pytest.approx(9.0)  # (p-1)(F+B+W)
    assert idle_zbv == pytest.approx(1.5)
    assert idle_zbv <= idle_1f1b / 3
    assert max(bubble_fraction(zbv)) == pytest.approx(1.5 / 24)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_activations_in_flight_are_p_microbatches_on_every_rank(p):
    """2p microbatch-chunks of half a stage each: 1F1B's rank-0 peak of p stages' worth, on every rank.
    Apart from them, the WEIGHT steps waiting after their backward (their inputs and output gradients):
    at most 2r + 1 on rank r, as in interleaved-zb."""
    lists = [build_schedule(p, 2, 3 * p, r, kind="zbv") for r in range(p)]
    assert [peak_in_flight(steps) for steps in lists] == [2 * p] * p
    pending = []
    for steps in lists:
        waiting = most = 0
        for step in steps:
            waiting += {B: 1, W: -1}.get(step[0].kind, 0)
            most = max(most, waiting)
        pending.append(most)
    assert pending == [2 * r + 1 for r in range(p)]


def test_layers_fill_the_v_in_stage_order():
    assert stage_layer_ids(8, 2, 2, 0, placement="v") == [[0, 1], [6, 7]]
    assert stage_layer_ids(8, 2, 2, 1, placement="v") == [[2, 3], [4, 5]]
    # --decoder-first/last-pipeline-num-layers count the first and last stage, both on rank 0
    assert stage_layer_ids(8, 2, 2, 0, 3, 1, placement="v") == [[0, 1, 2], [7]]
    assert stage_layer_ids(8, 2, 2, 1, 3, 1, placement="v") == [[3, 4], [5, 6]]
    with pytest.raises(ValueError, match=r"^--pipeline-schedule zbv splits --num-layers \(6\) over 2 x"):
        stage_layer_ids(6, 2, 2, 0, placement="v")


BASE = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1"]
BASE += ["--global-batch-size", "8", "--train-iters", "1", "--mock-data", "--vocab-size", "64"]
PP2_ZBV = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"]


def test_zbv_implies_two_chunks_per_rank():
    run = parse_run_config(BASE + ["--num-layers", "4"] + PP2_ZBV, LLAMA_DEFAULTS, 2)
    assert run.parallel.virtual_stages == 2 and run.parallel.placement.kind == "v"
    assert run.parallel.layer_ids(4, 0) == [[0], [3]]


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "1"],
            "--pipeline-schedule zbv runs exactly 2 model chunks per pipeline rank (V placement), but "
            "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank give 4",
        ),
        (["--num-layers", "6"], "--pipeline-schedule zbv splits --num-layers (6) over 2 x"),
        (
            ["--num-layers", "4", "--microbatch-group-size-per-virtual-pipeline-stage", "2"],
            "--microbatch-group-size-per-virtual-pipeline-stage applies to the interleaved schedules, not to",
        ),
        (
            [
                "--num-layers",
                "6",
                "--decoder-first-pipeline-num-layers",
                "3",
                "--decoder-last-pipeline-num-layers",
                "2",
            ],
            "must split evenly over the other 2 stages of the V",
        ),
    ],
)
def test_layouts_zbv_cannot_run_are_one_line(flags, message):
    with pytest.raises(ValueError) as info:
        parse_run_config(BASE + flags + PP2_ZBV, LLAMA_DEFAULTS, 2)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("p", [2, 4])
def test_step_time_model_extrapolates_zbv_exactly_and_keeps_its_lower_bound(p):
    """The planner simulates two microbatch counts and extrapolates (`pipeline_idle`); for zbv that equals
    the full simulation, and no zbv run idles less than the bound the pruned search relies on."""
    for m in (1, p, 3 * p + 1, 7 * p + 2):
        for backward, weight, transfer in ((2.0, 1.0, 0.0), (2.3, 0.9, 0.1)):
            full = simulate(
                p, 2, m, kind="zbv", backward_time=backward, weight_time=weight, transfer_time=transfer
            ).makespan - 2 * m * (1 + backward)
            idle = pipeline_idle(p, 2, m, None, 1.0, backward, transfer, "zbv", weight)
            assert idle == pytest.approx(full)
            assert idle >= least_idle(p, 1.0, backward, "zbv") - 1e-9
