"""The `multirank` mark: every test that starts other processes carries it, found from the code and checked as it runs.

`pytest -m "not multirank"` is the fast lane: the tests that run inside the pytest process alone. Marking by hand
drifts (a helper that starts ranks is called from a new test, and the fast lane quietly slows down), so the mark is
derived here, once, for every test module:

- at collection, a test is marked when its function, a fixture it names or a module-level function it reaches
  (in its own module or imported from another test module) refers to a process starter (`STARTERS`);
- while it runs, every process start (`multiprocessing`'s `Process.start`, `subprocess.Popen`) is counted, and an
  unmarked test that started one fails, naming the mark, so a starter the collection cannot see (a library call
  that launches ranks) is caught by the suite itself and added to `STARTERS`.
"""

from __future__ import annotations

import ast
import functools
import multiprocessing.process
import subprocess
from pathlib import Path

import pytest

MARK = "multirank"
# Names whose use starts processes: the rank harness, the launcher, the CLI's launching commands, subprocesses.
STARTERS = frozenset({
    "run_on_ranks", "launch_once", "launch_processes", "launch_local", "launch_config", "subprocess", "Popen",
    "check_call", "check_output", "run_verify", "calibrate",
})

_started = 0
_STARTED_BEFORE = pytest.StashKey[int]()


def _count_starts(start):
    @functools.wraps(start)
    def counted(*args, **kwargs):
        global _started
        _started += 1
        return start(*args, **kwargs)
    return counted


def pytest_configure(config):
    """Count every process start from now on."""
    multiprocessing.process.BaseProcess.start = _count_starts(multiprocessing.process.BaseProcess.start)
    subprocess.Popen.__init__ = _count_starts(subprocess.Popen.__init__)


def _names(node: ast.AST) -> set[str]:
    """Every name a function's body refers to, and the fixtures its parameters name."""
    names = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            names.add(child.id)
        elif isinstance(child, ast.Attribute):
            names.add(child.attr)
        elif isinstance(child, ast.arg):
            names.add(child.arg)
    return names


@functools.cache
def _module_functions(path: Path) -> tuple[dict[str, set[str]], dict[str, Path]]:
    """A module's functions (module level and in its classes) with the names each refers to, and the functions it
    imports from other test modules (name -> that module's path)."""
    tree = ast.parse(path.read_text(), str(path))
    functions: dict[str, set[str]] = {}
    imported: dict[str, Path] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.setdefault(node.name, set()).update(_names(node))
        elif isinstance(node, ast.ImportFrom) and node.module:
            source = path.parent / (node.module.split(".")[-1] + ".py")
            if source.exists() and source != path:
                imported.update({alias.asname or alias.name: source for alias in node.names})
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


def pytest_collection_modifyitems(items):
    """Mark every collected test whose code reaches a process starter."""
    for item in items:
        function = getattr(item, "function", None)
        if function is None or item.get_closest_marker(MARK):
            continue
        if function.__name__ in _starters(Path(str(item.fspath))):
            item.add_marker(MARK)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.stash[_STARTED_BEFORE] = _started  # a module's fixture may start the ranks in its first test's setup
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield  # a test that fails is reported as it failed, not for its mark
    started = _started - item.stash.get(_STARTED_BEFORE, _started)
    if started and not item.get_closest_marker(MARK):
        pytest.fail(f"{item.nodeid} started {started} process(es) but is not marked {MARK!r}: add its starter to "
                    f"STARTERS in tests/process_marks.py (or mark the test)", pytrace=False)
    return result
