"""The shape of the code itself: rooms that import one way, strategies that know no model, no re-export shims,
packages documented, one home for the layout rules and the overlap policy.

Pure tests (no processes), except one short training run that counts how often a run decides its layout, and
the profiled steps that count the files one step passes through.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from torch import nn

import paratrain
from paratrain.cli import build_parser, main
from paratrain.commands.options import config_from_args
from paratrain.comm import Comm
from paratrain.config import Config, ConfigError, ParallelSection, validate
from paratrain.errors import Violation
from paratrain.mesh import Mesh, MeshShape
from paratrain.models import get_model_config
from paratrain.parallel import rules
from paratrain.parallel.api import DataParallel, ParallelConfigError, PipelineParallel, parallelize, parallelize_run
from paratrain.parallel.pipeline.schedules import DEFAULT_SCHEDULE
from paratrain.parallel.rules import ZERO_STAGES, LayoutSpec
from paratrain.plan import Layout, LayoutError, SearchSpace, Workload, get_hardware, search, validate_layout

PACKAGE = Path(paratrain.__file__).parent


def _one_rank_mesh() -> Mesh:
    """A mesh of one CPU rank without a process group: every axis has one rank, so nothing communicates."""
    return Mesh(shape=MeshShape(), rank=0, groups={"pp": None, "dp": None, "tp": None, "world": None})


def import_graph(root: Path = PACKAGE.parent) -> dict[str, set[str]]:
    """paratrain's modules and the paratrain modules each imports, function-level imports included."""
    files = {}
    for path in (root / "paratrain").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def module_of(name: str) -> str | None:  # `paratrain.x.y.f` → the module `paratrain.x.y`
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {module_of(a.name) for a in node.names if a.name.startswith("paratrain")}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("paratrain"):
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else module_of(node.module)
                         for a in node.names}
        graph[name] = deps - {None, name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v] & graph.keys():
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_paratrain_imports_itself_back():
    graph = import_graph()
    assert "paratrain.commands.verify_model" in graph["paratrain.commands.verify"]  # imported inside a function
    assert import_cycles(graph) == []


# -- rooms: a subpackage of paratrain or a top-level module, read at folder level ---------------------

def room_of(module: str) -> str:
    """`paratrain.parallel.data.ddp` → `parallel`; `paratrain.train` → `train` (the package itself: `paratrain`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The rooms and the other rooms each imports (a module's imports, function-level included, are its room's)."""
    rooms: dict[str, set[str]] = {}
    for module, deps in graph.items():
        rooms.setdefault(room_of(module), set()).update(room_of(d) for d in deps)
    return {room: deps - {room} for room, deps in rooms.items()}


def test_the_room_graph_is_the_module_graph_at_folder_level():
    rooms = room_graph({"paratrain.a.x": {"paratrain.b"}, "paratrain.b": {"paratrain.a.y"}, "paratrain.a.y": set()})
    assert rooms == {"a": {"b"}, "b": {"a"}} and import_cycles(rooms) == [["a", "b"]]


def test_the_rooms_import_one_way():
    """No cycle between rooms (docs/architecture.md draws them): e.g. run/ reads --mem-budget with plan/'s
    parse_bytes, not the plan command's; a run's export lives in run/, so interop/ never imports run/."""
    rooms = room_graph(import_graph())
    assert {"models", "parallel", "run", "commands", "interop", "testing", "ranks"} <= rooms.keys()
    assert "parallel" in rooms["models"] and "run" in rooms["commands"]  # the graph sees imports
    assert import_cycles(rooms) == []


def test_no_strategy_imports_the_model():
    """parallel/ knows no model: a model names its own plan or is recognized by what it holds."""
    graph = import_graph()
    reached = {module: sorted(d for d in deps if room_of(d) == "models")
               for module, deps in graph.items() if room_of(module) == "parallel"}
    assert len(reached) > 20 and {m: d for m, d in reached.items() if d} == {}


def test_no_production_module_imports_the_test_helpers():
    graph = import_graph()
    assert "paratrain.ranks" in graph["paratrain.plan.calibrate"]  # calibration runs on ranks.py itself
    users = sorted(module for module, deps in graph.items()
                   if room_of(module) != "testing" and any(room_of(d) == "testing" for d in deps))
    assert users == []


# An import kept only to be imported from here again (flake8's "imported but unused" silenced).
SHIM = re.compile(r"#\s*noqa\s*:[^#\n]*\bF40[13]\b")


def test_the_shim_finder_finds_a_shim():
    silenced = "# noqa" + ": "  # spelled in two pieces, so that this file holds no shim line itself
    assert SHIM.search(f"from a import b  {silenced}F401  (kept importable)")
    assert SHIM.search(f"from a import *  {silenced}F401,F403") and not SHIM.search(f"import x  {silenced}E402")


def test_no_module_re_exports_another_modules_names():
    """Only a package's __init__ presents names from elsewhere: callers import a name from where it is defined."""
    root = PACKAGE.parent
    files = [path for folder in ("paratrain", "tests", "benchmarks") for path in (root / folder).rglob("*.py")]
    shims = [f"{path.relative_to(root)}:{number}" for path in files if path.name != "__init__.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if SHIM.search(line)]
    assert len(files) > 100 and shims == []


# A module is organised by what belongs together, read top to bottom in one sitting: about 600 lines is the guide
# (docs/architecture.md), and a cohesive module may pass it; a split made only to fit a number is worse than a long
# file. The ceiling catches a module that has become two.
LINE_CEILING = 900


def test_no_module_is_longer_than_one_sitting():
    lengths = {str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
               for path in PACKAGE.rglob("*.py")}
    over = {path: lines for path, lines in sorted(lengths.items()) if lines > LINE_CEILING}
    assert len(lengths) > 50 and over == {}, f"over {LINE_CEILING} lines, split each along a seam: {over}"


# Places outside a clone of the repository: the design notes and measurements it was built from. A clone does not
# have them, so the facts the code and docs need are copied in (docs/reference-numbers.md, benchmarks/results/).
OUTSIDE = re.compile("|".join(re.escape(name) for name in ("../" + "shared", "shared/" + "gpu", "DESIGN" + ".md",
                                                           "STYLE" + ".md", "RELIABILITY" + ".md")))


def test_nothing_in_the_repository_points_outside_it():
    root = PACKAGE.parent
    files = [path for folder in ("paratrain", "tests", "benchmarks", "docs", "configs") for path in (root / folder).rglob("*")
             if path.suffix in {".py", ".md", ".toml", ".sh", ".json"}] + [root / "README.md", root / "pyproject.toml"]
    pointers = [f"{path.relative_to(root)}:{number}" for path in files
                for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert len(files) > 100 and pointers == []


def test_every_package_says_what_it_holds():
    packages = [init for init in PACKAGE.rglob("__init__.py")]
    missing = [str(init.parent.relative_to(PACKAGE.parent)) for init in packages
               if not ast.get_docstring(ast.parse(init.read_text()))]
    assert len(packages) > 5 and missing == []


# -- the layout rules: one module, one list, one decision per run ------------------------------------

PROBE = "probe: a rule of paratrain.parallel.rules"


@pytest.fixture
def probe_rule(monkeypatch):
    """Break one rule function of the rules module for every layout: whoever reports it asked that module."""
    monkeypatch.setattr(rules, "zero_stage_violations", lambda zero, pp: [Violation("probe", PROBE)])


def test_parallelize_asks_the_rules_module(probe_rule):
    with pytest.raises(ParallelConfigError, match=PROBE):
        parallelize(nn.Linear(4, 4), _one_rank_mesh())


def test_the_trainers_preflight_asks_the_rules_module(probe_rule, capsys, tmp_path):
    with pytest.raises(ConfigError, match=PROBE):
        validate(Config())
    assert main(["train", "--out", str(tmp_path / "run"), "--steps", "1"]) == 2
    assert PROBE in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "refused before anything ran"


def test_the_planner_asks_the_rules_module(probe_rule, capsys):
    with pytest.raises(LayoutError, match=PROBE):
        validate_layout(2, 2, 1, 1, get_model_config("tiny"), 8, 1)
    work = Workload.for_model(get_model_config("tiny"), seq_len=256, global_batch=8)
    result = search(work, 4, get_hardware("h100-80gb"))
    assert result.searched > 0 and result.ranked == []
    assert "probe" in result.failures and "memory" not in result.failures
    assert main(["plan", "--model", "tiny", "--dp", "2"]) == 2
    assert PROBE in capsys.readouterr().err


def test_verify_asks_the_rules_module(probe_rule, capsys):
    for argv in (["verify", "--layouts", "dp2"],
                 ["verify", "--model-factory", "test_your_own_model:model_factory", "--layouts", "dp2"]):
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert PROBE in captured.err and "reference" not in captured.out, "refused before anything ran"


def test_one_train_run_decides_its_layout_once(monkeypatch, tmp_path):
    """The preflight decides the layout with the model and the batch; the trainer and parallelize take its verdict."""
    from paratrain.train import train

    calls = []
    decide = rules.layout_violations
    monkeypatch.setattr(rules, "layout_violations", lambda layout: calls.append(layout) or decide(layout))
    argv = ["train", "--model", "tiny", "--steps", "1", "--global-batch", "2", "--seq-len", "16", "--eval-batches",
            "1", "--sample-tokens", "0", "--no-progress", "--data", str(Path(json.__file__).parent),
            "--out", str(tmp_path / "run")]
    train(config_from_args(build_parser().parse_args(argv)))
    assert len(calls) == 1
    assert calls[0].model == get_model_config("tiny") and calls[0].global_batch == 2 and calls[0].seq_len == 16


@pytest.mark.parametrize("rule", ["fp8_violations", "offload_violations", "document_mask_violations",
                                  "compile_violations"])
def test_the_features_rules_are_layout_rules(rule, monkeypatch, capsys, tmp_path):
    """What a feature needs of the layout (FP8 bf16, offloaded parameters ZeRO-3, a document mask or compile under
    cp) is decided by the rules module alone: parallelize and the trainer's preflight report what it says."""
    monkeypatch.setattr(rules, rule, lambda *args: [Violation("probe", PROBE)])
    with pytest.raises(ParallelConfigError, match=PROBE):
        parallelize(nn.Linear(4, 4), _one_rank_mesh())
    assert main(["train", "--out", str(tmp_path / "run"), "--steps", "1"]) == 2
    assert PROBE in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "refused before anything ran"


def test_parallelize_refuses_a_verdict_on_another_layout():
    checked = rules.check_layout(LayoutSpec(dp=1, zero=1))
    assert parallelize_run(nn.Linear(4, 4), _one_rank_mesh(), data=DataParallel(zero=1), checked=checked)[0] is not None
    with pytest.raises(ParallelConfigError, match="verdict on another layout"):
        parallelize_run(nn.Linear(4, 4), _one_rank_mesh(), data=DataParallel(zero=2), checked=checked)


def test_the_layout_enumerations_have_one_home():
    zero_choices = ParallelSection.__dataclass_fields__["zero"].metadata["choices"]
    assert zero_choices == ZERO_STAGES == SearchSpace().zero
    with pytest.raises(ParallelConfigError, match="--zero must be 0, 1, 2 or 3"):
        DataParallel(zero=4)
    defaults = [ParallelSection().schedule, PipelineParallel().schedule, SearchSpace().schedule, Layout().schedule,
                LayoutSpec(dp=1).schedule]
    assert all(default == DEFAULT_SCHEDULE for default in defaults), defaults


# -- one name per option ---------------------------------------------------------------------------

def _actions(command: str) -> list:
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    return subparsers.choices[command]._actions


def test_plan_and_verify_take_the_trainers_options_as_the_trainer_spells_them():
    train = {a.dest: a for a in _actions("train")}
    for command in ("plan", "verify"):
        shared = [a for a in _actions(command) if a.dest in train]
        assert len(shared) >= 10, command
        for action in shared:
            assert action.option_strings[:1] == train[action.dest].option_strings[:1], (command, action.dest)
            assert action.help.split(" (default:")[0] == train[action.dest].help.split(" (default:")[0]
        # no option of its own spelled like one of train's, except --calibrate's --out and --nproc
        spelled = {s: a.dest for a in _actions(command) for s in a.option_strings}
        clashes = {s for a in train.values() for s in a.option_strings if s in spelled and spelled[s] != a.dest}
        assert clashes <= {"--out", "--nproc", "-h", "--help"}, (command, clashes)


# -- what overlaps with compute: one policy ---------------------------------------------------------

def test_prefetch_and_reductions_in_flight_ask_one_overlap_policy(monkeypatch):
    mesh = _one_rank_mesh()
    assert Comm(mesh).overlaps_compute() is False  # the CPU: gloo shares the cores with compute
    for overlaps in (False, True):
        monkeypatch.setattr(Comm, "overlaps_compute", lambda self, overlaps=overlaps: overlaps)
        zero3, _ = parallelize(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), mesh, data=DataParallel(zero=3))
        zero2, _ = parallelize(nn.Linear(4, 4), mesh, data=DataParallel(zero=2))
        assert zero3.engine.prefetch is overlaps
        assert zero3.engine._in_flight_limit == zero2.engine._in_flight_limit == int(overlaps)


# -- the parallel model's contract: nothing outside paratrain.parallel reaches past it -------------------

MODEL_INTERNALS = {"engine", "comm", "scaler"}


def reaches_into_a_model(source: str) -> list[str]:
    """`x.engine`, `x.comm`, `x.scaler` where x is a model (a name or attribute called `model` or `*_model`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in MODEL_INTERNALS:
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name == "model" or name.endswith("_model"):
                found.append((node.lineno, ast.unparse(node)))
    return [f"line {line}: {text}" for line, text in sorted(found)]


def test_the_model_reach_finder_finds_a_reach():
    assert reaches_into_a_model("run.model.engine.masters()\nx = self.model.scaler\nmodel.comm.reset()") == [
        "line 1: run.model.engine", "line 2: self.model.scaler", "line 3: model.comm"]
    assert reaches_into_a_model("self.comm.all_gather(a, b)\nrun.comm.reset()\ntimer.comm") == []


def test_nothing_outside_parallel_reaches_into_a_models_engine_comm_or_scaler():
    outside = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "parallel"]
    reaches = {str(p.relative_to(PACKAGE)): found for p in outside if (found := reaches_into_a_model(p.read_text()))}
    assert len(outside) > 50 and reaches == {}


def test_the_parallel_model_keeps_its_contract():
    from paratrain.parallel.contract import TrainableModel

    model, _ = parallelize(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), _one_rank_mesh(), data=DataParallel(zero=3))
    assert isinstance(model, TrainableModel)
    assert model.masters() and model.replicated_over("0.weight") == ("dp_replicate", "tp")
    assert model.replicated_over("0.weight", at_rest=True) == ("dp_replicate", "tp")
    ddp, _ = parallelize(nn.Linear(4, 4), _one_rank_mesh(), data=DataParallel(zero=0))
    assert ddp.replicated_over("weight") == ddp.replicated_over("weight", at_rest=True) == ("dp", "cp", "tp")


# -- the data-parallel engines know their strategy only ------------------------------------------------

# The engines' modules: a feature that plugs into them (a gather codec, where the optimizer steps, a layout of
# units the builder computes) reaches them through its extension point, and they name none of them.
ENGINE_MODULES = ("parallel/data/zero3.py", "parallel/data/units.py", "parallel/data/ddp.py",
                  "parallel/data/engine.py", "parallel/data/buckets.py")
PLUGGED_FEATURES = re.compile(r"fp8|offload|expert", re.IGNORECASE)


def test_the_feature_finder_finds_a_feature():
    assert PLUGGED_FEATURES.search("# offloaded shards") and PLUGGED_FEATURES.search("an FP8-gathered weight")
    assert PLUGGED_FEATURES.search("holds Experts") and not PLUGGED_FEATURES.search("a codec's placement")


def test_no_engine_module_names_a_feature_that_plugs_into_it():
    """Comments and docstrings included: an engine says "codec", "placement", "axis of their own"."""
    named = {module: [number for number, line in enumerate((PACKAGE / module).read_text().splitlines(), 1)
                      if PLUGGED_FEATURES.search(line)] for module in ENGINE_MODULES}
    assert {module: lines for module, lines in named.items() if lines} == {}


def test_the_engine_protocol_holds_the_strategys_verbs_only():
    """What a placement needs of an engine is the placement's interface (`offload.HostPlaced`), not `Engine`'s."""
    from paratrain.parallel.data.engine import Engine
    from paratrain.parallel.data.offload import HostPlaced

    from paratrain.parallel.data.ddp import DataParallelEngine
    from paratrain.parallel.data.groups import GroupedEngine
    from paratrain.parallel.data.zero3 import FullyShardedEngine

    placement = {name for name in vars(HostPlaced) if not name.startswith("_")}
    assert placement and not placement & set(vars(Engine)), placement & set(vars(Engine))
    # and every engine implements it, besides the contract
    lacking = {cls.__name__: sorted(name for name in placement | {"after_step", "finish_gradients"}
                                    if not callable(getattr(cls, name, None)))
               for cls in (DataParallelEngine, FullyShardedEngine, GroupedEngine)}
    assert {name: names for name, names in lacking.items() if names} == {}


# -- one training step's path through the code --------------------------------------------------------

# The most paratrain files one train_step may pass through, per layout (the loss, fused into the head, one of them:
# parallel/loss.py): (ZeRO stage, parallelize's options, ranks, files). The reference model's own file is one of
# them. FP8 and offload add their own modules only; a pipeline its runner, schedule and exchanges. The mesh is not
# one: each axis's group, size, coordinate and ranks are resolved once (`Comm.axes`), and ZeRO-3's row split once
# per unit (`FlatParam`), not asked of mesh.py and shard.py per collective and per parameter.
STEP_FILES = {
    "ddp": (0, {}, 2, 9),
    "zero3": (3, {}, 2, 10),
    "zero3_fp8": (3, {"precision": "bf16", "fp8": "tensorwise"}, 2, 11),
    "zero3_offload": (3, {"offload": "optimizer"}, 2, 12),
    "1f1b_over_ddp": (0, {"pp": 2}, 4, 12),
}


def _step_files(rank: int, world: int, zero: int, options: dict) -> list[str]:
    """The paratrain files one `train_step` (after a warm-up step) calls into on this rank."""
    import sys
    import warnings

    from parallel_cases import adamw, batches, make_model
    from paratrain.train import train_step

    options = dict(options)
    offload, pp = options.pop("offload", None), options.pop("pp", 1)
    if pp > 1:
        options["pipeline"] = PipelineParallel(schedule="1f1b")
    mesh = paratrain.init_mesh(dp=world // pp, pp=pp)
    with warnings.catch_warnings():  # (offload on the CPU says it saves nothing here)
        warnings.simplefilter("ignore")
        model, optimizer = parallelize(make_model(), mesh, optimizer=adamw,
                                       data=DataParallel(zero=zero, offload=offload), **options)
    x, y = batches()[0]
    replicas, replica = world // pp, mesh.coord("dp")
    mine = [(x[replica::replicas], y[replica::replicas])]
    train_step(model, optimizer, mine, 1.0)  # the first step makes its lazy state
    seen = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            seen.add(str(Path(frame.f_code.co_filename).relative_to(PACKAGE)))

    sys.setprofile(profile)
    try:
        train_step(model, optimizer, mine, 1.0)
    finally:
        sys.setprofile(None)
    return sorted(seen)


@pytest.mark.parametrize("layout", sorted(STEP_FILES))
def test_one_train_step_passes_through_few_files(layout):
    from paratrain.testing import run_on_ranks

    zero, options, world, most = STEP_FILES[layout]
    files = run_on_ranks(_step_files, world, zero, options, timeout=120)[-1]  # the last rank: a pipeline's loss
    assert "parallel/model.py" in files and "train.py" in files, files  # the profile saw the step
    assert len(files) <= most, f"{len(files)} files: {files}"
    assert "faults.py" not in files, "fault injection wraps the step from outside"
