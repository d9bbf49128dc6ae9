"""The `multirank` mark: every test that starts other processes carries it, found from the code and checked as it runs.

`pytest -m "not multirank"` is the fast lane: the tests that run inside the pytest process alone. Marking by hand
drifts (a helper that starts ranks is called from a new test, and the fast lane quietly slows down), so the mark is
derived here, once, for every test module:

- at collection, a test is marked when its function, a fixture it names or a module-level function it reaches
  (in its own module or imported from another test module) refers to a process starter (`STARTERS`);
- while it runs, every process it starts that runs Python (`multiprocessing`'s `Process.start`, a `subprocess` of
  the interpreter or of paratrain's command) is counted, and an unmarked test that started one fails, naming the
  mark, so a starter the collection cannot see (a library call that launches ranks) is caught by the suite itself
  and added to `STARTERS`. Tools that libraries run on the side (a font cache's `fc-list`, `git`) are not ranks;
  neither is the pool of compile workers Inductor keeps for the whole session (the first test to compile would
  otherwise be charged for it).

The marked tests run in two lanes, each one test after another on one worker (`lane`): the parity, memory and
compile tests of `tests/parallel/`, whose ranks compute and compare with no clock tighter than a hang bound, and
the rest (the launcher, fault, checkpoint and benchmark tests, whose clocks allow for a loaded machine). One lane
alone leaves a third of the second core idle while its ranks start, meet and wait; two keep both cores busy. A
test that starts one process at a time and no ranks (a command or a benchmark script run as a subprocess) needs one
core, as an in-process test does: marked `single_process` by hand, it runs beside the others on any worker. The mark
is checked as the test runs: a watcher samples the test's process tree ten times a second, and a test that ever has
two Python processes working under it at once (a leaf of the tree: ranks, a launcher's workers) fails, naming the
count. `PARATRAIN_TEST_PROCESSES=FILE` writes each marked test's largest count to FILE, to find the tests the mark
fits.
"""

from __future__ import annotations

import ast
import functools
import multiprocessing.process
import os
import re
import subprocess
import threading
import traceback
from collections import defaultdict
from pathlib import Path

import pytest

MARK = "multirank"
SINGLE = "single_process"
# Names and strings whose use starts processes: the rank harness, the launcher, subprocesses, and the commands that
# launch ranks or workers when a test calls the command line in-process (`main(["verify", ...])`).
STARTERS = frozenset({
    "run_on_ranks", "launch_once", "launch_processes", "launch_local", "launch_config", "subprocess", "Popen",
    "check_call", "check_output", "verify", "--calibrate", "--workers", "workers", "wandb",
})
_PYTHON = re.compile(r"^(python[\d.]*|paratrain|torchrun)$")

# The rooms whose marked tests form the second lane (`pytest_collection_modifyitems`), by their folder under tests/.
COMPUTE_LANE = ("parallel",)

_started = 0
_STARTED_BEFORE = pytest.StashKey[int]()
# Processes a test does not start itself: multiprocessing's forkserver and resource tracker, Inductor's compile
# workers. Each is a leaf of the tree while it waits.
_FORKSERVER = b"multiprocessing.forkserver"
_MACHINERY = (_FORKSERVER, b"multiprocessing.resource_tracker", b"torch/_inductor/compile_worker")


def _runs_python(popen, args, *rest, **kwargs) -> bool:
    command = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    program = str(command[0]).split()[0] if command else ""
    return bool(_PYTHON.match(os.path.basename(program)))


def _count_starts(start, counts=lambda *args, **kwargs: True):
    @functools.wraps(start)
    def counted(*args, **kwargs):
        global _started
        if counts(*args, **kwargs) and not any("torch/_inductor" in frame.filename for frame in traceback.extract_stack()):
            _started += 1
        return start(*args, **kwargs)
    return counted


def _working_processes(root: int) -> int:
    """How many Python processes under `root` start none of their own (the machinery above left out): two ranks
    are two, a launcher with one worker is one, a command that runs ranks under it is as many as its ranks."""
    parents = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stat:
                    fields = stat.read()
            except OSError:  # it exited while being read
                continue
            parents[int(entry.name)] = int(fields[fields.rindex(b")") + 2:].split()[1])
    children = defaultdict(list)
    for pid, parent in parents.items():
        children[parent].append(pid)
    leaves, stack = [], list(children[root])
    while stack:
        pid = stack.pop()
        if children[pid]:
            stack.extend(children[pid])
        else:
            leaves.append(pid)
    count = 0
    for pid in leaves:
        line = _command(pid)
        program = line.split(b"\0")[0].decode(errors="replace")
        if not program or not _PYTHON.match(os.path.basename(program)):
            continue
        # A rank forked from the forkserver carries the server's command line; the server is the one whose parent
        # is not a server.
        forked_rank = _FORKSERVER in line and _FORKSERVER in _command(parents[pid])
        if forked_rank or not any(part in line for part in _MACHINERY):
            count += 1
    return count


def _command(pid: int) -> bytes:
    """A process's command line, its words separated by NUL bytes; empty once it has exited."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read()
    except OSError:
        return b""


class _Watch(threading.Thread):
    """The largest number of working processes under this one while a test runs, sampled ten times a second from
    its start until `stop()`."""

    def __init__(self):
        super().__init__(daemon=True)
        self.most = 0
        self._done = threading.Event()
        self.start()

    def run(self):
        while not self._done.wait(0.1):
            self.most = max(self.most, _working_processes(os.getpid()))

    def stop(self):
        """End the sampling (again: a no-op)."""
        self._done.set()
        self.join()


def pytest_configure(config):
    """Count every process start from now on."""
    multiprocessing.process.BaseProcess.start = _count_starts(multiprocessing.process.BaseProcess.start)
    subprocess.Popen.__init__ = _count_starts(subprocess.Popen.__init__, _runs_python)


def _name_of(node: ast.AST) -> str | None:
    """The name or string one node refers to (a parameter's name: the fixture it asks for), if any."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, (ast.arg, ast.keyword)):
        return node.arg
    return None


def _names(node: ast.AST) -> set[str]:
    """Every name and string a subtree refers to."""
    return {name for child in ast.walk(node) if (name := _name_of(child)) is not None}


@functools.cache
def _test_module(name: str) -> Path | None:
    """A module of the tests by its bare name (as test modules import each other), in whichever folder it lives."""
    found = sorted(Path(__file__).parent.rglob(f"{name}.py"))
    return found[0] if found else None


@functools.cache
def _module_functions(path: Path) -> tuple[dict[str, set[str]], dict[str, Path]]:
    """A module's functions (module level and in its classes) and module-level constants with the names each refers
    to, and the names it imports from other test modules (name -> that module's path).

    One walk of the module: each name is added to every function around it (nested functions' names are their
    enclosing function's too), so no function's subtree is walked twice."""
    tree = ast.parse(path.read_text(), str(path))
    functions: dict[str, set[str]] = {}
    imported: dict[str, Path] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):  # e.g. VERIFY = ["verify", ...], used by several tests
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    functions.setdefault(target.id, set()).update(_names(node.value or target))
    stack = [(tree, ())]
    while stack:
        node, around = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            around = (*around, functions.setdefault(node.name, set()))
        elif around and (name := _name_of(node)) is not None:
            for names in around:
                names.add(name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            source = _test_module(node.module.split(".")[-1])
            if source is not None and source != path:
                imported.update({alias.asname or alias.name: source for alias in node.names})
        stack.extend((child, around) for child in ast.iter_child_nodes(node))
    return functions, imported


@functools.cache
def _starters(path: Path) -> frozenset[str]:
    """The names in a module whose use starts processes: its own functions that reach a starter, and the starting
    functions it imports from other test modules."""
    functions, imported = _module_functions(path)
    starting = set(STARTERS) | {name for name, source in imported.items() if name in _starters(source)}
    grew = True
    while grew:
        grew = False
        for name, refs in functions.items():
            if name not in starting and refs & starting:
                starting.add(name)
                grew = True
    return frozenset(starting)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups to name the tests' scopes
def pytest_collection_modifyitems(items):
    """Mark every collected test whose code reaches a process starter, and give each test its group for pytest-xdist's
    `--dist loadgroup`: the marked tests one of two lanes (`lane`; each runs one test after another on one worker,
    the two side by side, and pytest-xdist starts the largest groups first), every other test, `single_process`
    ones included, its module's (a module's fixtures are made once, on one worker)."""
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and not item.get_closest_marker(MARK) and \
                function.__name__ in _starters(Path(str(item.fspath))):
            item.add_marker(MARK)
        ranks = item.get_closest_marker(MARK) and not item.get_closest_marker(SINGLE)
        group = lane(Path(str(item.fspath))) if ranks else Path(str(item.fspath)).name
        item.add_marker(pytest.mark.xdist_group(group))


def lane(path: Path) -> str:
    """The lane of a marked test module: the compute lane for the rooms in `COMPUTE_LANE` (their ranks only compute
    and compare), the clocked lane for the rest (launches, faults, timeouts, with clocks that allow for a machine
    the other lane loads)."""
    room = path.relative_to(Path(__file__).parent).parts[0]
    return f"{MARK}-compute" if room in COMPUTE_LANE else f"{MARK}-clocked"


_WATCH = pytest.StashKey[_Watch]()


def _watched(item) -> bool:
    """A `single_process` test is watched to check its mark; with PARATRAIN_TEST_PROCESSES set, every marked one."""
    return bool(item.get_closest_marker(SINGLE) or (os.environ.get("PARATRAIN_TEST_PROCESSES")
                                                    and item.get_closest_marker(MARK))) and os.path.isdir("/proc")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.stash[_STARTED_BEFORE] = _started  # a module's fixture may start the ranks in its first test's setup
    if _watched(item):  # from the setup on, for the same reason
        item.stash[_WATCH] = _Watch()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield  # a test that fails is reported as it failed, not for its mark
    watch = item.stash.get(_WATCH, None)
    if watch is not None:
        watch.stop()
        if log := os.environ.get("PARATRAIN_TEST_PROCESSES"):
            with open(log, "a") as out:
                out.write(f"{watch.most}\t{item.nodeid}\n")
        if item.get_closest_marker(SINGLE) and watch.most > 1:
            pytest.fail(f"{item.nodeid} is marked {SINGLE!r} but ran {watch.most} Python processes at once: it "
                        f"belongs in the {MARK!r} lane (remove the mark)", pytrace=False)
    started = _started - item.stash.get(_STARTED_BEFORE, _started)
    if started and not item.get_closest_marker(MARK):
        pytest.fail(f"{item.nodeid} started {started} process(es) but is not marked {MARK!r}: add its starter to "
                    f"STARTERS in tests/process_marks.py (or mark the test)", pytrace=False)
    return result


def pytest_runtest_teardown(item):
    watch = item.stash.get(_WATCH, None)
    if watch is not None:  # a setup that failed leaves no call to stop it
        watch.stop()
