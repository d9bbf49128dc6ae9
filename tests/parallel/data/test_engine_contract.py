"""Every data-parallel engine keeps one contract (`paratrain.parallel.data.engine.Engine`): one test, every engine.

Each engine shards a plain module over 2 gloo ranks and goes through a step by the contract's
calls: backward, finish_gradients, drop_gradients, the optimizer, after_step, zero_grad. What
each call must leave behind is checked the same way for DDP, ZeRO-1, ZeRO-2 and ZeRO-3, against
one process holding the whole batch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.comm import Comm
from paratrain.mesh import MeshShape, build_mesh
from paratrain.parallel.data.ddp import DataParallelEngine
from paratrain.parallel.data.engine import Engine
from paratrain.parallel.data.zero3 import FullyShardedEngine
from paratrain.precision import precision_policy
from paratrain.testing import run_on_ranks
from parallel_cases import launch_once

ENGINES = ["ddp", "zero1", "zero2", "zero3"]


class Net(nn.Module):
    """Not paratrain's: blocks in a ModuleList (ZeRO-3 units), an odd-sized parameter, one never used."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(7, 7), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(7, 3)
        self.unused = nn.Parameter(torch.ones(3, 2))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _net() -> Net:
    torch.manual_seed(0)  # every rank builds the same replica
    return Net()


def _batch(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 5, generator=g)[rows], torch.randn(8, 3, generator=g)[rows]


def _engine(kind: str, model: nn.Module, mesh) -> Engine:
    comm, policy = Comm(mesh), precision_policy("fp32")
    if kind == "zero3":
        return FullyShardedEngine(model, comm, policy, grad_reduction="sum")
    return DataParallelEngine(model, comm, policy, zero=ENGINES.index(kind), grad_reduction="sum")


def _contract(engine: Engine, model: nn.Module, mesh) -> dict:
    """Walk one step through the contract; what each call left behind."""
    n, r = mesh.size("dp"), mesh.coord("dp")
    x, y = _batch(slice(r * 8 // n, (r + 1) * 8 // n))
    facts = {"is_engine": isinstance(engine, Engine), "names": engine.master_names()}
    facts["rows_match"] = [name for name, _, _ in engine.master_rows()] == engine.master_names()
    facts["row_counts"] = [hi - lo for _, (lo, hi), _ in engine.master_rows()]
    facts["master_rows"] = [m.shape[0] if m.dim() else 1 for m in engine.masters()]
    ((model(x) - y) ** 2).sum().div(8).backward()
    used = engine.finish_gradients()
    facts["used"] = used.tolist()
    facts["again"] = engine.finish_gradients().tolist()  # no gradient since: the same counts, nothing waits
    engine.drop_gradients([i for i, c in enumerate(facts["used"]) if c == 0])
    facts["grads"] = {name: None if m.grad is None else m.grad.clone()
                      for name, m in zip(engine.master_names(), engine.masters())}
    sq = engine.local_grad_sq_sum()
    facts["sq_is_0d"] = sq.dim() == 0 and sq.device == mesh.device
    torch.distributed.all_reduce(sq) if engine.grads_sharded else None
    facts["norm"] = float(sq.sqrt())
    # A gradient replaced by a new tensor (no view of the engine's buffers any more) still counts.
    first = next(m for m in engine.masters() if m.grad is not None)
    kept = first.grad
    first.grad = kept * 3
    each = sum(float(m.grad.double().pow(2).sum()) for m in engine.masters() if m.grad is not None)
    facts["sq_follows_grads"] = float(engine.local_grad_sq_sum()) == pytest.approx(each, rel=1e-6)
    first.grad = kept
    optimizer = torch.optim.SGD(engine.masters(), lr=0.1)
    optimizer.step()
    engine.after_step()
    facts["params"] = {name: t.clone() for name, t in engine.full_parameters()}
    engine.zero_grad()
    facts["no_grads"] = all(m.grad is None for m in engine.masters())
    facts["resident_keys"] = sorted(engine.resident_bytes())
    return facts


def _all(rank, world):
    mesh = build_mesh(MeshShape(dp=world))
    out = {}
    for kind in ENGINES:
        model = _net()
        out[kind] = _contract(_engine(kind, model, mesh), model, mesh)
    return out


def _reference() -> dict:
    model = _net()
    x, y = _batch(slice(None))
    ((model(x) - y) ** 2).sum().div(8).backward()
    grads = {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values() if g is not None]))
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return {"grads": grads, "norm": float(norm), "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


_RESULTS: dict = {}


@pytest.mark.parametrize("kind", ENGINES)
def test_every_engine_keeps_the_contract(kind):
    ref = _reference()
    for rank, per_rank in enumerate(launch_once(_RESULTS, 2, _all)):
        facts = per_rank[kind]
        assert facts["is_engine"] and facts["rows_match"]
        assert facts["names"] == list(ref["params"])
        assert facts["row_counts"] == facts["master_rows"], "master_rows says how many rows each master holds"
        unused = facts["names"].index("unused")
        # This rank's own flags: the model sums them over the data ranks in its agreement.
        assert facts["used"][unused] == 0 and all(c == 1 for i, c in enumerate(facts["used"]) if i != unused)
        assert facts["again"] == facts["used"]
        for name, grad in facts["grads"].items():
            expected = ref["grads"][name]
            if expected is None:
                assert grad is None, f"{name}: no rank used it, so no gradient (the optimizer leaves it alone)"
                continue
            rows = expected.reshape(expected.shape[0] if expected.dim() else 1, -1)
            if kind != "ddp":  # ZeRO: this rank's rows of the reduced gradient
                c = -(-rows.shape[0] // 2)
                rows = rows[rank * c:(rank + 1) * c]
            torch.testing.assert_close(grad.reshape(rows.shape), rows, rtol=1e-6, atol=1e-7)
        assert facts["sq_is_0d"]
        assert facts["sq_follows_grads"]
        assert facts["norm"] == pytest.approx(ref["norm"], rel=1e-6)
        for name, value in ref["params"].items():
            torch.testing.assert_close(facts["params"][name], value, rtol=1e-6, atol=1e-7, msg=name)
        assert facts["no_grads"]
        assert facts["resident_keys"] == ["grads", "master", "params"]


def test_no_caller_probes_an_engine():
    """The contract is the interface: nothing asks an engine what it has."""
    import pathlib
    import re

    import paratrain

    root = pathlib.Path(paratrain.__file__).parent
    probes = [f"{path.relative_to(root)}:{i}" for path in root.rglob("*.py")
              for i, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"hasattr\(.*engine", line)]
    assert probes == []


def test_one_process_runs_every_engine_too():
    run_on_ranks(_all, 1, timeout=60)
