"""The planner reads a pipeline schedule's traits off its actions: what the simulator sees, for any schedule."""

import pytest

from paratrain.models import get_model_config
from paratrain.parallel.pipeline import schedules
from paratrain.parallel.pipeline.schedules import Action, Kind, ScheduleName, build_schedule
from paratrain.parallel.pipeline.simulator import simulate, traits_of, validate
from paratrain.plan import Layout, Workload, estimate_memory, get_hardware, in_flight_microbatches, step_time
from paratrain.plan.compute import SPLIT_BACKWARD_COST, stage_pass_times
from paratrain.plan.activations import loss_backward_bytes
from paratrain.plan.memory import stage_memory

LLAMA_7B = get_model_config("llama2-7b")
H100 = get_hardware("h100-80gb")

# (pp, m, v) per schedule: m below, at and above pp; interleaved only where m % pp == 0, with 2 and 3 chunks
CASES = [(name, pp, m, 1) for name in ScheduleName if name is not ScheduleName.INTERLEAVED
         for pp, m in [(2, 1), (2, 5), (3, 2), (4, 3), (4, 8), (8, 16)]]
CASES += [(ScheduleName.INTERLEAVED, pp, m, v) for pp, m, v in [(2, 2, 2), (2, 6, 3), (4, 4, 2), (4, 8, 3), (8, 16, 2)]]


def _simulated_bubble(result) -> float:
    """A rank's idle time in micro-batch times (f + b = 3 at simulate's default costs f = 1, b = 2, w = 1)."""
    return max(result.makespan - busy for busy in result.busy) / 3.0


def _planned_bubble(work: Workload, lay: Layout) -> float:
    """step_time's bubble over the slowest stage's time per micro-batch."""
    t = step_time(work, lay, H100)
    m = lay.num_microbatches(work.global_batch)
    return t.bubble / ((t.compute + t.tp_comm + t.pp_comm) / m)


@pytest.mark.parametrize("name, pp, m, v", CASES)
def test_planner_takes_in_flight_and_bubble_from_the_simulated_schedule(name, pp, m, v):
    result = simulate(build_schedule(name, pp, m, v))
    assert [in_flight_microbatches(name, pp, m, v, stage) for stage in range(pp)] == pytest.approx(
        [peak / v for peak in result.peak_in_flight], rel=1e-12)
    work = Workload.for_model(LLAMA_7B, seq_len=1024, global_batch=m)
    assert _planned_bubble(work, Layout(pp=pp, schedule=name, virtual_stages=v)) == pytest.approx(
        _simulated_bubble(result), rel=1e-9)


def test_zb_h1_with_fewer_micro_batches_than_stages_idles_more_than_a_third_of_1f1b():
    # m < p: the first backward returns to rank 0 only after p forwards and p input-grads, whatever
    # the deferral, so ZB-H1 cannot fill two thirds of 1F1B's p - 1 idle micro-batch times.
    work = Workload.for_model(LLAMA_7B, seq_len=1024, global_batch=2)
    zb = _planned_bubble(work, Layout(pp=4, schedule="zb-h1"))
    assert zb == pytest.approx(5 / 3, rel=1e-9)  # makespan 11 of f = B = W = 1 against 6 busy: 5 idle
    assert (4 - 1) / 3 < zb < _planned_bubble(work, Layout(pp=4, schedule="1f1b"))


def _one_f_one_b_late_w(pp: int, m: int, v: int, rank: int) -> list[Action]:
    """1F1B with a split backward, each W after the next micro-batch's B: a schedule only the data describes."""
    order, pending = [], []
    for action in schedules._one_f_one_b(pp, m, v, rank):
        order.append(action)
        if action.kind is Kind.B:
            order += pending
            pending = [Action(Kind.W, action.microbatch, action.stage)]
    return order + pending


@pytest.fixture
def gpipe_replaced_by_a_new_schedule(monkeypatch):
    """Register the toy generator in place of GPipe's, with no change to the planner; forget cached traits."""
    monkeypatch.setitem(schedules._GENERATORS, ScheduleName.GPIPE, _one_f_one_b_late_w)
    traits_of.cache_clear()
    yield ScheduleName.GPIPE
    traits_of.cache_clear()


def test_a_schedule_given_only_as_data_flows_through_the_planner(gpipe_replaced_by_a_new_schedule):
    name, pp, m = gpipe_replaced_by_a_new_schedule, 4, 8
    toy = build_schedule(name, pp, m)
    validate(toy)
    assert toy.split_backward
    result, reference = simulate(toy), simulate(build_schedule("1f1b", pp, m))
    work = Workload.for_model(LLAMA_7B, seq_len=1024, global_batch=m)
    lay, lay_1f1b = Layout(pp=pp, schedule=name), Layout(pp=pp, schedule="1f1b")

    # memory: each stage's activations scale with the micro-batches the toy keeps in flight there (the loss's
    # backward, on the last stage, is one at a time whatever the schedule)
    once = {pp - 1: loss_backward_bytes(1024, LLAMA_7B.vocab_size)}
    for stage in range(pp):
        ratio = (stage_memory(work, lay, stage).activations - once.get(stage, 0)) / (
            stage_memory(work, lay_1f1b, stage).activations - once.get(stage, 0))
        assert ratio == pytest.approx(result.peak_in_flight[stage] / reference.peak_in_flight[stage], rel=1e-12)
    assert estimate_memory(work, lay).activations > estimate_memory(work, lay_1f1b).activations

    # time: the split backward costs its second walk of the graph; the bubble is the simulated one
    for stage in range(pp):
        split, whole = stage_pass_times(work, lay, H100, stage), stage_pass_times(work, lay_1f1b, H100, stage)
        assert split.backward == pytest.approx(whole.backward * SPLIT_BACKWARD_COST, rel=1e-12)
        assert split.forward == whole.forward
    assert _planned_bubble(work, lay) == pytest.approx(_simulated_bubble(result), rel=1e-9)
    assert _simulated_bubble(result) not in (pp - 1, (pp - 1) / 3)  # neither GPipe's nor ZB-H1's
