"""paratrain.compat: every private or version-dependent torch API paratrain uses, one function each.

Each function is exercised on the installed torch (a private API torch dropped fails here, by
name), and each feature detection is checked against a simulated older torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from paratrain import compat
from paratrain.cli import build_parser
from paratrain.commands.train import config_from_args

ROOT = Path(__file__).parents[2]


def test_the_installed_torch_is_one_paratrain_supports_and_every_place_states_the_same_minimum():
    installed = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    assert installed >= compat.MIN_TORCH, torch.__version__
    minimum = ".".join(map(str, compat.MIN_TORCH))
    assert f'"torch>={minimum}"' in (ROOT / "pyproject.toml").read_text()
    assert f"torch {minimum} or newer" in (ROOT / "README.md").read_text()


# -- the elastic launcher ---------------------------------------------------------------------------------

def _older_launch_config():
    """torch's LaunchConfig as releases before `shutdown_timeout` define it (2.11)."""
    from torch.distributed.launcher.api import LaunchConfig

    fields = [(f.name, f.type, f) for f in dataclasses.fields(LaunchConfig) if f.name not in compat.NEWER_LAUNCH_FIELDS]
    return dataclasses.make_dataclass("LaunchConfig", fields)


def test_paratrain_train_nproc_2_builds_its_launch_config_on_a_torch_without_shutdown_timeout(monkeypatch):
    import torch.distributed.launcher.api as api

    import paratrain.launch as launch

    older = _older_launch_config()
    # Wherever the launcher may look the class up: torch's module, or a name bound at import.
    monkeypatch.setattr(api, "LaunchConfig", older)
    monkeypatch.setattr(launch, "LaunchConfig", older, raising=False)
    cfg = config_from_args(build_parser().parse_args(["train", "--model", "tiny", "--nproc", "2"]))
    config = launch.launch_config(cfg)
    assert isinstance(config, older) and config.nproc_per_node == 2 and config.start_method == "forkserver"


@pytest.mark.parametrize("node_timeout, interval", [(15, 5), (3, 1), (10, 3)])
def test_node_timeout_is_torchs_rendezvous_heartbeat_expiry(node_timeout, interval):
    """--node-timeout reaches torch's c10d rendezvous as the keep-alive it reads: a heartbeat every third of it
    (whole seconds), a node expired after about --node-timeout without one (15 s: torch's own default)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    import paratrain.launch as launch

    cfg = config_from_args(build_parser().parse_args(
        ["train", "--model", "tiny", "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400",
         "--rdzv-id", "job", "--node-timeout", str(node_timeout)]))
    config = launch.launch_config(cfg)
    params = RendezvousParameters(backend="c10d", endpoint=config.rdzv_endpoint, run_id=config.run_id,
                                  min_nodes=2, max_nodes=2, **config.rdzv_configs)
    store = dist.HashStore()
    settings = create_handler(store, C10dRendezvousBackend(store, "job"), params)._settings
    assert settings.keep_alive_interval == datetime.timedelta(seconds=interval)
    expiry = (settings.keep_alive_interval * settings.keep_alive_max_attempt).total_seconds()
    assert abs(expiry - node_timeout) <= interval / 2


def test_the_launch_config_keeps_newer_fields_where_torch_has_them_and_refuses_unknown_ones():
    from torch.distributed.launcher.api import LaunchConfig

    newer = {f.name for f in dataclasses.fields(LaunchConfig)} >= compat.NEWER_LAUNCH_FIELDS
    config = compat.elastic_launch_config(min_nodes=1, max_nodes=1, nproc_per_node=2, shutdown_timeout=7)
    assert getattr(config, "shutdown_timeout", None) == (7 if newer else None)
    with pytest.raises(TypeError, match="shutdown_timout"):  # a misspelt field is not dropped
        compat.elastic_launch_config(min_nodes=1, max_nodes=1, nproc_per_node=2, shutdown_timout=7)



def test_rendezvous_events_are_named_by_the_frame_as_torchs_stack_walk_names_them(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    # torch's own, from its module's code: a launch from this process (another test's) may have replaced it already.
    spec = importlib.util.find_spec(dynamic_rendezvous.__name__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    torchs = fresh.get_method_name
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", torchs)  # restored after the test

    def record():  # as DynamicRendezvousHandler._record asks for the name of the method that called it
        return dynamic_rendezvous.get_method_name(), dynamic_rendezvous.get_method_name(1)

    def next_rendezvous():
        return record()

    expected = next_rendezvous()
    compat.name_rendezvous_events_by_frame()
    assert dynamic_rendezvous.get_method_name is not torchs
    assert next_rendezvous() == expected == ("next_rendezvous", "record")
    assert dynamic_rendezvous.get_method_name(10_000) == torchs(10_000) == "no_method_name"

# -- collectives --------------------------------------------------------------------------------------

def test_the_flat_collectives_are_torchs_newer_names_where_it_has_them_else_the_older(monkeypatch):
    newer = (getattr(dist, "reduce_scatter_single", None), getattr(dist, "all_gather_single", None))
    assert (compat.reduce_scatter_single, compat.all_gather_single) == (
        newer[0] or dist.reduce_scatter_tensor, newer[1] or dist.all_gather_into_tensor)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    try:
        older = importlib.reload(compat)
        assert older.reduce_scatter_single is dist.reduce_scatter_tensor
        assert older.all_gather_single is dist.all_gather_into_tensor
    finally:
        monkeypatch.undo()
        importlib.reload(compat)


def test_the_default_store_is_the_one_the_group_was_created_on():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        before = store.num_keys()
        assert compat.default_store().compare_set("paratrain/test", "", "first") == b"first"
        assert compat.default_store().compare_set("paratrain/test", "", "second") == b"first"
        assert store.num_keys() == before + 1, "the key went into the group's store (under torch's own prefix)"
    finally:
        dist.destroy_process_group()


# -- autograd -----------------------------------------------------------------------------------------

def test_backward_is_detected_its_pass_identified_and_a_callback_runs_at_its_end():
    seen, ended = [], []
    x = torch.ones(3, requires_grad=True)

    def hook(grad):
        seen.append((compat.in_backward(), compat.backward_pass_id()))
        compat.at_backward_end(lambda: ended.append(compat.in_backward()))
        return grad

    x.register_hook(hook)
    assert not compat.in_backward() and compat.backward_pass_id() == -1
    (x * 2).sum().backward()
    (x * 3).sum().backward()
    assert [s[0] for s in seen] == [True, True] and seen[0][1] != -1 and seen[0][1] != seen[1][1]
    assert ended == [True, True], "each callback ran once, as its backward finished"


def _alone_in_backward(make_grad_holders=lambda grad: None, shared: bool = False) -> list[bool]:
    """held_alone() of the gradient a custom Function's backward receives, after `make_grad_holders(grad)`;
    `shared`: its output is added to another branch's, so autograd hands the same gradient to both."""
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            held = make_grad_holders(grad)  # noqa: F841 - kept alive while held_alone() looks
            seen.append(compat.held_alone(grad))
            return grad

    x, z = torch.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    zz = z * 1.0  # made first, so its backward runs after the probe's
    out = Probe.apply(x * 1.0)
    ((out + zz if shared else out) * 2.0).sum().backward()
    return seen


def test_a_gradient_is_held_alone_only_without_other_references_or_views():
    assert _alone_in_backward() == [True], "a product's fresh gradient"
    assert _alone_in_backward(lambda grad: grad[:2]) == [False], "a view shares its storage"
    assert _alone_in_backward(lambda grad: grad.detach()) == [False], "another tensor on the same storage"
    assert _alone_in_backward(shared=True) == [False], "a gradient autograd hands to two branches"


# -- dispatch modes and pytrees -----------------------------------------------------------------------

def test_a_dispatch_mode_sees_each_operator_and_its_leaves():
    calls = []

    class Seen(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append((func.__name__, sum(isinstance(x, torch.Tensor) for x in compat.tree_leaves((args, kwargs)))))
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.ones(2).add(torch.ones(2))
    assert ("add.Tensor", 2) in calls
    assert compat.tree_leaves({"a": [1, (2, 3)], "b": 4}) == [1, 2, 3, 4]


def test_a_wrapper_subclass_is_seen_through_to_its_inner_tensors():
    from torch.testing._internal.two_tensor import TwoTensor  # torch's own minimal wrapper subclass

    a, b = torch.zeros(2), torch.ones(2)
    wrapped = TwoTensor(a, b)
    assert compat.is_wrapper_subclass_type(TwoTensor) and not compat.is_wrapper_subclass_type(torch.Tensor)
    inner = compat.inner_tensors(wrapped)
    assert len(inner) == 2 and inner[0] is a and inner[1] is b
    assert compat.inner_tensors(a) is None


# -- optimizers and the flight recorder ---------------------------------------------------------------

def test_fused_optimizer_devices_are_the_ones_torch_optim_accepts_fused_for():
    devices = set(compat.fused_optimizer_devices())
    assert "cuda" in devices
    param = torch.nn.Parameter(torch.zeros(2))
    if "cpu" in devices:
        torch.optim.AdamW([param], fused=True)  # accepted
    else:
        with pytest.raises(RuntimeError):
            torch.optim.AdamW([param], fused=True)


def test_the_flight_record_is_json_under_the_newer_name_or_the_older(monkeypatch):
    from torch._C import _distributed_c10d as c10d

    assert "version" in json.loads(compat.flight_record_json())  # torch's dump format, with no group yet
    calls = []
    monkeypatch.delattr(c10d, "_dump_fr_trace_json", raising=False)
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda *args: calls.append(args) or b"{}", raising=False)
    assert compat.flight_record_json() == b"{}" and calls == [(True, False)]


# -- torch.compile ------------------------------------------------------------------------------------

def test_the_modules_inductor_generated_are_found_with_their_allocation_functions():
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: (x * 2).sin() + 1, backend="inductor", dynamic=False)
    compiled(torch.ones(8))
    allocators = [name for namespace in compat.compiled_module_namespaces() for name, value in namespace.items()
                  if name.startswith("empty_strided") and callable(value)]
    assert allocators, "TensorMemory follows these to see a compiled kernel's output buffers"


def test_an_observing_mode_sees_compiled_code_run_and_not_its_tracing():
    seen = []

    class Seen(compat.ObservingMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x.mm(x).relu(), backend="aot_eager", dynamic=False)
    with Seen():
        compiled(torch.ones(2, 2))  # compiled under the mode, then run under it
        traced, seen[:] = len(seen), []
        compiled(torch.ones(2, 2))
    assert torch.ops.aten.mm.default in seen and len(seen) == traced, "the second call runs what the first ran"


def test_grouped_mm_is_a_matmul_per_group_or_none():
    """torch's private grouped GEMM, where this torch runs it for these tensors, equals a matmul per group of rows;
    rows whose bytes are not 16-aligned get None (the caller's loop)."""
    x, w = torch.randn(5, 8), torch.randn(3, 8, 4)
    offsets = torch.tensor([2, 2, 5], dtype=torch.int32)
    out = compat.grouped_mm(x, w, offsets)
    assert out is not None  # CPU fp32 on torch 2.13
    torch.testing.assert_close(out, torch.cat([x[:2] @ w[0], x[2:] @ w[2]]))
    assert compat.grouped_mm(torch.randn(5, 6), torch.randn(3, 6, 4), offsets) is None


# -- the private optimizer and FP8 APIs --------------------------------------------------------------

def test_adams_lazy_state_initialization_is_the_state_its_step_creates():
    stepped, initialized = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    for p in (stepped, initialized):
        p.grad = torch.full((3,), 0.5)
    by_step, by_init = torch.optim.AdamW([stepped]), torch.optim.AdamW([initialized])
    by_step.step()
    assert compat.has_init_group(by_init)
    lists = ([], [], [], [], [], [])
    assert compat.init_group(by_init, by_init.param_groups[0], *lists) is False
    assert lists[0] == [initialized] and lists[1][0] is initialized.grad
    assert set(by_init.state[initialized]) == set(by_step.state[stepped]), "the moments and step a step creates"


def test_only_fused_adam_reads_the_grad_scale_as_it_steps():
    param = torch.nn.Parameter(torch.ones(2))
    assert compat.steps_with_amp_scaling(torch.optim.AdamW([param], fused=True))
    assert not compat.steps_with_amp_scaling(torch.optim.AdamW([param])) and not compat.steps_with_amp_scaling(
        torch.optim.SGD([param]))


def test_scaled_mm_multiplies_fp8_operands_back_by_their_scales():
    assert compat.has_scaled_mm()
    a, b = torch.randn(16, 32), torch.randn(32, 16)
    scale_a, scale_b = torch.tensor(2.0), torch.tensor(4.0)
    a8, b8 = (a * 2).to(torch.float8_e4m3fn), (b * 4).to(torch.float8_e4m3fn)
    out = compat.scaled_mm(a8, b8.t().contiguous().t(), scale_a.reciprocal(), scale_b.reciprocal(), torch.float32)
    exact = (a8.float() / 2) @ (b8.float() / 4)
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5)


def test_the_cuda_memory_recorder_is_where_compat_calls_it(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(path))
    compat.record_memory_history(7)
    compat.dump_memory_snapshot("snapshot.pickle")
    compat.record_memory_history(None)
    assert calls == [{"max_entries": 7}, "snapshot.pickle", {"enabled": None}]


def test_the_installed_torch_has_the_cuda_memory_recorder():
    assert callable(torch.cuda.memory._record_memory_history) and callable(torch.cuda.memory._dump_snapshot)


def test_muons_private_iteration_and_lr_reproduce_torchs_step():
    """`muon_orthogonalize` and `muon_adjusted_lr` (torch's private `_muon` functions) give torch.optim.Muon's step."""
    from paratrain.compat import muon_adjusted_lr, muon_orthogonalize

    weight = torch.nn.Parameter(torch.randn(24, 40, generator=torch.Generator().manual_seed(0)))
    grad = torch.randn(24, 40, generator=torch.Generator().manual_seed(1))
    expected = weight.detach().clone()
    update = muon_orthogonalize(grad.lerp(grad * 0.05, 0.95).bfloat16(), (3.4445, -4.7750, 2.0315), 5, 1e-7)
    expected.mul_(1 - 0.02 * 0.1).add_(update, alpha=-muon_adjusted_lr(0.02, None, weight.shape))
    weight.grad = grad
    torch.optim.Muon([weight], lr=0.02).step()
    assert torch.equal(weight.detach(), expected)
