"""The step-time breakdown: phases minus the communication they were blocked on."""

import types
from collections import defaultdict

import pytest
import torch

from paratrain import metrics
from paratrain.comm import Comm
from paratrain.mesh import Mesh, MeshShape
from paratrain.metrics import StepTimer


class _FakeComm:
    """The host-clock half of `Comm` (the CPU's): seconds blocked per axis."""

    def __init__(self):
        self.blocked_s = defaultdict(float)

    def exposed_s(self):
        return dict(self.blocked_s)


class _Clock:
    """A perf_counter that moves only when told: the breakdown's arithmetic, whatever the machine's load."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def test_blocked_communication_moves_out_of_the_phase_it_happened_in(monkeypatch):
    clock, comm = _Clock(), _FakeComm()
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=clock))
    timer = StepTimer(comm)
    start = clock()
    with timer.phase("forward_backward"):
        clock.advance(0.05)
        comm.blocked_s["dp"] += 0.02  # as if a wait inside had blocked 20 ms of those 50
        comm.blocked_s["pp"] += 0.01
    clock.advance(0.003)  # between phases: the step's "other"
    with timer.phase("optimizer"):
        clock.advance(0.02)
    total = clock() - start
    parts = timer.breakdown(total)
    assert parts["comm_exposed_s"] == {"dp": pytest.approx(0.02)}
    assert parts["pipeline_wait_s"] == pytest.approx(0.01)
    assert parts["compute_s"] == pytest.approx(0.05 - 0.03)
    assert parts["optimizer_s"] == pytest.approx(0.02)
    assert parts["other_s"] == pytest.approx(0.003)
    assert parts["data_s"] == parts["checkpoint_s"] == 0.0
    accounted = (parts["compute_s"] + parts["optimizer_s"] + sum(parts["comm_exposed_s"].values())
                 + parts["pipeline_wait_s"] + parts["other_s"])
    assert accounted == pytest.approx(total, abs=1e-12)



def test_on_cuda_each_step_reads_only_events_the_gpu_has_passed(monkeypatch):
    """On CUDA the stream's waits are timed by CUDA events. Reading an event of the step being timed
    (`synchronize`, `elapsed_time`) makes the host wait for the GPU to finish that step, every step: the
    breakdown of each step reads only the events of the step before (whose time it reports), which the
    step's own host read has passed. Here the events are fakes that note which step made them."""
    now = {"step": 0}
    reads = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.step = now["step"]

        def record(self, stream=None):
            pass

        def synchronize(self):
            reads.append((self.step, now["step"]))

        def elapsed_time(self, end):
            reads.append((self.step, now["step"]))
            return 10.0 * self.step  # ms: each step's wait is as long as its number says

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    mesh = Mesh(shape=MeshShape(), rank=0, groups={"pp": None, "dp": None, "tp": None}, device=torch.device("cuda"))
    comm = Comm(mesh)
    for step in (1, 2, 3):
        now["step"] = step
        comm.reset()  # as the trainer begins each step
        timer = StepTimer(comm)
        with timer.phase("forward_backward"):
            comm.wait([None], "dp")  # on CUDA the stream waits here, timed between two events
        parts = timer.breakdown(1.0)
        assert all(made < reading for made, reading in reads), reads
        assert parts["comm_exposed_s"] == ({"dp": pytest.approx(0.01 * (step - 1))} if step > 1 else {})
        reads.clear()
