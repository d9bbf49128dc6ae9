"""Pipeline schedules are pure data: checked, timed and drawn without processes."""

import itertools

import pytest

from paratrain.parallel.pipeline.schedules import SCHEDULES, Action, Kind, Schedule, ScheduleError, build_schedule
from paratrain.parallel.pipeline.simulator import (
    check_p2p_order, dependencies, draw_timeline, peak_in_flight, simulate, validate)

F, B, W = Kind.F, Kind.B, Kind.W


def every_schedule(pps=(1, 2, 3, 4), mbs=range(1, 9)):
    """Every buildable (name, pp, m, v) of the grid; interleaved with v in {2, 3} where m % pp == 0."""
    for name, pp, m in itertools.product(SCHEDULES, pps, mbs):
        for v in ((2, 3) if name == "interleaved" else (1,)):
            if name != "interleaved" or m % pp == 0:
                yield build_schedule(name, pp, m, v)


def hand_made(actions, split=False, pp=2, m=2):
    rows = tuple(tuple(Action(kind, mb, stage) for kind, mb, stage in row) for row in actions)
    return Schedule("hand", pp=pp, num_microbatches=m, virtual_stages=1, split_backward=split, actions=rows)


# --- building ---------------------------------------------------------------------------------------------------


def test_layout_helpers_follow_megatron_interleaving():
    schedule = build_schedule("interleaved", pp=4, num_microbatches=8, virtual_stages=2)
    assert schedule.num_stages == 8
    assert schedule.stages_of(1) == (1, 5)
    assert [schedule.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [schedule.chunk_of(s) for s in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert not schedule.split_backward and build_schedule("zb-h1", 2, 2).split_backward


def test_gpipe_runs_all_forwards_then_all_backwards():
    schedule = build_schedule("gpipe", pp=2, num_microbatches=3)
    forwards = tuple(Action(F, mb, 1) for mb in range(3))
    assert schedule.actions[1] == forwards + tuple(Action(B, mb, 1) for mb in range(3))


def test_1f1b_warms_up_with_p_minus_1_minus_rank_forwards():
    schedule = build_schedule("1f1b", pp=3, num_microbatches=4)
    short = [" ".join(f"{a.kind.value}{a.microbatch}" for a in row) for row in schedule.actions]
    assert short == ["F0 F1 F2 B0 F3 B1 B2 B3",
                     "F0 F1 B0 F2 B1 F3 B2 B3",
                     "F0 B0 F1 B1 F2 B2 F3 B3"]
    # Fewer micro-batches than stages: fewer warmup forwards, still valid.
    assert [a.kind for a in build_schedule("1f1b", pp=4, num_microbatches=1).actions[0]] == [F, B]


def test_zb_h1_defers_each_ranks_weight_grads_by_its_rank():
    schedule = build_schedule("zb-h1", pp=2, num_microbatches=3)
    short = [" ".join(f"{a.kind.value}{a.microbatch}" for a in row) for row in schedule.actions]
    assert short == ["F0 F1 B0 W0 F2 B1 W1 B2 W2",
                     "F0 B0 F1 B1 W0 F2 B2 W1 W2"]


def test_interleaved_runs_groups_of_pp_microbatches_chunk_by_chunk():
    schedule = build_schedule("interleaved", pp=2, num_microbatches=4, virtual_stages=2)
    forwards = [(a.microbatch, schedule.chunk_of(a.stage)) for a in schedule.actions[0] if a.kind is F]
    assert forwards == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    # Warmup 2(p-1-r) + (v-1)p = 4 forwards on rank 0 before the steady state's first F then B.
    assert [a.kind for a in schedule.actions[0][:6]] == [F, F, F, F, F, B]


@pytest.mark.parametrize("args, message", [
    (("pipedream", 2, 4), r"unknown schedule 'pipedream'; choose one of gpipe, 1f1b, interleaved, zb-h1"),
    (("1f1b", 0, 4), r"pp must be an integer of at least 1, got 0"),
    (("gpipe", 2, 0), r"num_microbatches must be an integer of at least 1, got 0"),
    (("interleaved", 2, 4, 1), r"--schedule interleaved needs --virtual-stages 2 or more"),
    (("interleaved", 4, 6, 2), r"interleaved needs the micro-batches per step \(6\) divisible by --pp 4"),
    (("1f1b", 2, 4, 2), r"virtual stages are only for 'interleaved'; use 1 with '1f1b'"),
])
def test_bad_arguments_are_one_line_errors(args, message):
    with pytest.raises(ScheduleError, match=message) as error:
        build_schedule(*args)
    assert isinstance(error.value, ValueError) and "\n" not in str(error.value)


# --- validation -------------------------------------------------------------------------------------------------


def test_every_generated_schedule_is_valid_and_p2p_ordered():
    count = 0
    for schedule in every_schedule():
        validate(schedule)
        check_p2p_order(schedule)
        count += 1
    assert count == 4 * 8 * 3 + 2 * (8 + 4 + 2 + 2)


def test_a_backward_before_its_forward_is_rejected():
    bad = hand_made([[(B, 0, 0), (F, 0, 0)], [(F, 0, 1), (B, 0, 1)]], m=1)
    with pytest.raises(ScheduleError, match=r"rank 0 runs B\(mb=0, stage=0\) before F\(mb=0, stage=0\)"):
        validate(bad)


def test_two_ranks_waiting_on_each_other_is_a_deadlock():
    # Rank 1 wants micro-batch 1 before rank 0 sends it; rank 0 first waits for micro-batch 0's grad.
    bad = hand_made([[(F, 0, 0), (B, 0, 0), (F, 1, 0), (B, 1, 0)],
                     [(F, 0, 1), (F, 1, 1), (B, 0, 1), (B, 1, 1)]])
    with pytest.raises(ScheduleError, match=r"rank 0 waits for B\(mb=0, stage=1\) \(needed by B\(mb=0, stage=0\)\), "
                                            r"which rank 1 runs after F\(mb=1, stage=1\), itself blocked: deadlock"):
        validate(bad)


def test_messages_received_out_of_send_order_are_rejected():
    # Deadlock-free by dependencies alone, but rank 1's first receive would match micro-batch 0's activation.
    bad = hand_made([[(F, 0, 0), (F, 1, 0), (B, 0, 0), (B, 1, 0)],
                     [(F, 1, 1), (F, 0, 1), (B, 0, 1), (B, 1, 1)]])
    with pytest.raises(ScheduleError, match=r"p2p order mismatch: message 0 from rank 0 to rank 1 is "
                                            r"activation\(mb=0, stage=0\) as sent but activation\(mb=1, stage=0\)"):
        validate(bad)


@pytest.mark.parametrize("actions, split, message", [
    ([[(F, 0, 1), (B, 0, 1)], [(F, 0, 1), (B, 0, 1)]], False,
     r"rank 0 runs F\(mb=0, stage=1\) but holds only stages \(0,\)"),
    ([[(F, 0, 0)], [(F, 0, 1), (B, 0, 1)]], False, r"B\(mb=0, stage=0\) is missing from rank 0"),
    ([[(F, 0, 0), (F, 0, 0), (B, 0, 0)], [(F, 0, 1), (B, 0, 1)]], False, r"rank 0 runs F\(mb=0, stage=0\) twice"),
    ([[(F, 0, 0), (B, 0, 0), (W, 0, 0)], [(F, 0, 1), (B, 0, 1)]], False, r"does not split the backward"),
    ([[(F, 0, 0), (W, 0, 0), (B, 0, 0)], [(F, 0, 1), (B, 0, 1), (W, 0, 1)]], True,
     r"rank 0 runs W\(mb=0, stage=0\) before B\(mb=0, stage=0\)"),
    ([[(F, 0, 0), (B, 0, 0), (F, 5, 0)], [(F, 0, 1), (B, 0, 1)]], False, r"micro-batch outside 0..0"),
])
def test_malformed_schedules_name_the_problem(actions, split, message):
    with pytest.raises(ScheduleError, match=message):
        validate(hand_made(actions, split=split, m=1))


# --- simulation: the numbers of Narayanan et al. 2021 and Qi et al. 2023 ----------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m", [(1, 1), (1, 5), (2, 1), (2, 8), (3, 2), (4, 4), (4, 8), (5, 16), (8, 3)])
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, pp, m):
    result = simulate(build_schedule(name, pp, m))
    assert result.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    assert result.makespan == pytest.approx((m + pp - 1) * 3.0)


@pytest.mark.parametrize("pp, m, v", [(1, 3, 2), (2, 2, 2), (2, 6, 3), (3, 3, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3),
                                      (4, 12, 4), (8, 16, 2)])
def test_interleaving_divides_the_bubble_by_v(pp, m, v):
    result = simulate(build_schedule("interleaved", pp, m, v))
    assert result.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-12)


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 4), (3, 2), (3, 5), (4, 3), (4, 8), (8, 16)])
def test_zb_h1_bubble_is_below_1f1b(pp, m):
    # f = B = W: the zero-bubble paper's setting (full backward b = 2, split into B = 1 and W = 1).
    zb = simulate(build_schedule("zb-h1", pp, m), f=1.0, b=2.0, w=1.0)
    one_f_one_b = simulate(build_schedule("1f1b", pp, m), f=1.0, b=2.0)
    assert zb.bubble_fraction < one_f_one_b.bubble_fraction
    if m >= pp:  # the optimum: only the first forwards' ramp, (p-1)·F, is idle on each rank
        assert zb.bubble_fraction == pytest.approx((pp - 1) / (3 * m + pp - 1), abs=1e-12)
        assert zb.makespan == pytest.approx(3 * m + pp - 1)


@pytest.mark.parametrize("pp, m", [(1, 4), (2, 3), (4, 2), (4, 8), (6, 12)])
def test_in_flight_microbatches(pp, m):
    assert peak_in_flight(build_schedule("1f1b", pp, m)) == tuple(min(pp - r, m) for r in range(pp))
    assert peak_in_flight(build_schedule("gpipe", pp, m)) == (m,) * pp
    assert peak_in_flight(build_schedule("zb-h1", pp, m)) == (min(pp, m),) * pp


@pytest.mark.parametrize("pp, m, v", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 4, 3)])
def test_interleaving_holds_more_chunk_activations(pp, m, v):
    # Megatron's warmup plus one: 2(p-1) + (v-1)p + 1 chunks on rank 0, i.e. p + (p-1)/v ranks' worth of layers.
    peak = simulate(build_schedule("interleaved", pp, m, v)).peak_in_flight
    assert peak[0] == min(2 * (pp - 1) + (v - 1) * pp + 1, m * v)
    assert all(a >= b for a, b in zip(peak, peak[1:]))


def test_every_generated_schedule_respects_dependencies_and_costs():
    for schedule in every_schedule(mbs=(1, 3, 4, 6)):
        result = simulate(schedule, f=1.0, b=3.0, w=1.0, comm=0.25)
        end = {t.action: t.end for row in result.timeline for t in row}
        for rank, row in enumerate(result.timeline):
            assert [t.action for t in row] == list(schedule.actions[rank])
            assert all(a.end <= b.start + 1e-12 for a, b in zip(row, row[1:]))
            for timed in row:
                for dep in dependencies(schedule, timed.action):
                    hop = 0.25 if schedule.rank_of(dep.stage) != rank else 0.0
                    assert end[dep] + hop <= timed.start + 1e-12
        # Splitting the backward or the model into chunks moves work, never adds it.
        assert result.busy == pytest.approx([schedule.num_microbatches * 4.0] * schedule.pp)


def test_communication_latency_delays_only_cross_rank_dependencies():
    assert simulate(build_schedule("1f1b", 1, 4), comm=5.0).makespan == pytest.approx(12.0)
    # GPipe: the forward ramp and the backward ramp each cross p-1 links.
    pp, m, comm = 4, 6, 0.5
    result = simulate(build_schedule("gpipe", pp, m), comm=comm)
    assert result.makespan == pytest.approx((m + pp - 1) * 3.0 + 2 * (pp - 1) * comm)


def test_costs_are_checked():
    with pytest.raises(ScheduleError, match="w <= b"):
        simulate(build_schedule("zb-h1", 2, 2), b=1.0, w=2.0)


# --- drawing ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_timeline_png_is_written(tmp_path, name, v):
    import matplotlib.image

    schedule = build_schedule(name, pp=4, num_microbatches=8, virtual_stages=v)
    path = draw_timeline(simulate(schedule), tmp_path / "plots" / f"{name}.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 600
    assert pixels[..., :3].std() > 0.1  # boxes, not a blank canvas


def test_timeline_accepts_a_schedule_and_a_title(tmp_path):
    path = draw_timeline(build_schedule("1f1b", 2, 3), str(tmp_path / "t.png"), title="two ranks")
    assert path.exists() and path.stat().st_size > 5_000
