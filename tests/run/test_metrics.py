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


def test_expert_load_sums_the_owners_rows_and_states_the_max_over_mean():
    """Rows of 4 ranks (dp 2 × tp 2: the tp = 1 ranks see their data rank's tokens again and do not count)."""
    per_rank = {"moe.0.e0": (6, 6, 2, 2), "moe.0.e1": (2, 2, 6, 6), "moe.0.aux": (0.5, 0.5, 0.7, 0.7),
                "moe.1.e0": (8, 8, 8, 8), "moe.1.e1": (0, 0, 0, 0), "moe.1.aux": (1.0, 1.0, 1.0, 1.0),
                "tokens": (1, 1, 1, 1)}
    load = metrics.expert_load(per_rank, owners=[0, 2], data_ranks=2)
    assert load["tokens_per_expert"] == {"layer0": [8, 8], "layer1": [16, 0]}
    assert load["load_max_mean"] == {"layer0": 1.0, "layer1": 2.0} and load["load_max_mean_worst"] == 2.0
    assert load["aux_loss"] == pytest.approx((0.5 + 0.7) / 2 + 1.0)
    assert metrics.expert_load({"tokens": (1, 1)}, [0, 1], 2) is None  # a dense model: no entry


def _moe_config(out, ep: int = 1):
    from paratrain.config import Config

    cfg = Config()
    cfg.model.name = "tiny-moe"
    cfg.model.n_layers, cfg.model.dim, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.ffn_dim = 2, 64, 4, 2, 64
    cfg.data.seq_len = 32
    cfg.train.steps, cfg.train.global_batch, cfg.train.micro_batch = 3, 8, 8 // (2 if ep > 1 else 1)
    cfg.train.warmup_steps, cfg.train.eval_every, cfg.train.eval_batches, cfg.train.sample_tokens = 1, 0, 1, 4
    cfg.parallel.ep = ep
    cfg.run.out, cfg.run.progress = str(out), False
    return cfg


def _train_moe(rank, world_size, out):
    from paratrain.train import train

    train(_moe_config(out, ep=2))


def test_a_moe_run_logs_expert_load_and_aux_loss_alike_on_one_process_and_on_ep2(tmp_path):
    """Every step's record has each layer's tokens per expert (the last micro-batch of every data rank: 8
    sequences × 32 tokens × top-2), their max/mean and the aux loss apart from the LM loss; two ranks with
    ep = 2 route the same tokens to the same experts as one process."""
    from paratrain.testing import run_on_ranks
    from paratrain.train import train

    train(_moe_config(tmp_path / "one"))
    one = metrics.read_metrics(tmp_path / "one" / "metrics.jsonl")
    run_on_ranks(_train_moe, 2, str(tmp_path / "two"), timeout=180)
    two = metrics.read_metrics(tmp_path / "two" / "metrics.jsonl")
    for a, b in zip(one, two, strict=True):
        load = a["moe"]
        assert set(load["tokens_per_expert"]) == {"layer0", "layer1"}
        assert all(sum(t) == 8 * 32 * 2 and len(t) == 8 for t in load["tokens_per_expert"].values())
        assert all(1 <= r <= 8 for r in load["load_max_mean"].values())
        assert load["aux_loss"] > 0 and load["aux_loss"] != pytest.approx(a["loss"])
        assert b["moe"]["tokens_per_expert"] == load["tokens_per_expert"]
        assert b["moe"]["aux_loss"] == pytest.approx(load["aux_loss"], rel=1e-5)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["comm_bytes"]["ep"] > 0


def test_a_record_still_being_written_is_left_out_when_the_file_is_read(tmp_path):
    """A reader of a live run's metrics.jsonl (a test waiting for steps, `report` on a running job) may meet the
    record rank 0 is writing, cut short: it is not a record yet."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"comm_bytes": {"dp": 5583')
    assert [r["step"] for r in metrics.read_metrics(path)] == [1, 2]
    path.write_text('{"step": 1}\n{"step": 2}\n')
    assert [r["step"] for r in metrics.read_metrics(path)] == [1, 2]
