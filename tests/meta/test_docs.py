"""The documentation stays true to the repository: links, file paths, Python names, options, CI's command.

The README and the pages under docs/ name files, modules and options that other changes move or
rename; each test here reads the pages and fails naming the page and the stale name. The recipes the
pages show are run by `test_your_own_model.py`. Pure tests: no processes.
"""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from paratrain.cli import build_parser

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# Options of the tools the pages show beside paratrain's own: torchrun's, Slurm's srun's, tensorboard's.
FOREIGN_OPTIONS = {"--nproc-per-node", "--rdzv-backend", "--nodes", "--ntasks-per-node", "--gpus-per-task", "--logdir"}


def prose(text: str) -> str:
    """The page without its fenced code blocks (a link or a path inside code is an example, not a reference)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", prose(page.read_text()), flags=re.M)}


def links(page: Path) -> list[str]:
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text()))
            if not re.match(r"[a-z]+:", target)]


def test_the_readme_links_every_docs_page_and_every_page_is_reached():
    linked = {(ROOT / t.split("#")[0]).resolve() for t in links(ROOT / "README.md")}
    assert PAGES[1:], "docs/ holds the pages the README points to"
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_points_at_an_existing_file_and_heading(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert broken == [], f"{page.name}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_repository_path_a_page_names_exists(page):
    named = re.findall(r"`((?:paratrain|tests|benchmarks|configs)/[\w/.-]*)`", prose(page.read_text()))
    named += re.findall(r"\b((?:paratrain|tests|benchmarks|configs)/[\w/-]+\.(?:py|toml|md))\b",
                        "\n".join(code_blocks(page.read_text())))
    missing = sorted({p for p in named if not (ROOT / p).exists()})
    assert missing == [], f"{page.name} names files that do not exist: {missing}"


def tree_files(tree: str) -> list[tuple[str, list[str]]]:
    """Each `.py` file the package tree names, with the folders it may sit in.

    An entry (names up to two spaces) sits in the folder its indentation says; a file named in its
    description sits there or in the folder the entry is (`data/  … engine.py`, `plan/ data/ models/
    … models/tp_plans.py`). A line indented past the entries continues the description above.
    """
    lines = tree.splitlines()
    found, path, bases = [], [lines[0].rstrip("/")], []
    for line in lines[1:]:
        indent = len(line) - len(line.lstrip())
        entry, _, description = line.strip().partition("  ")
        if indent > 8:
            entry, description = "", line
        else:
            path = path[:indent // 2]
            here, names = "/".join(path), entry.split()
            folders = [n.rstrip("/") for n in names if n.endswith("/")]
            found += [(n, [here]) for n in names if n.endswith(".py")]
            inside = [f"{here}/{f}" for f in folders]
            bases = inside if names == [f"{f}/" for f in folders] == names[:1] else [here, *inside]
            path.append(folders[0] if len(folders) == 1 else "?")  # a folder's entries follow it
        found += [(n, bases) for n in re.findall(r"[\w/]+\.py\b", description)]
    return found


def test_every_file_of_the_architecture_page_exists():
    text = ARCHITECTURE.read_text()
    tree = code_blocks(text)[0]
    assert tree.startswith("paratrain/\n"), "the page opens with the package tree"
    named = tree_files(tree)
    assert len(named) >= 30, named
    missing = [f"{folders[-1]}/{name}" for name, folders in named
               if not any((ROOT / folder / name).is_file() for folder in folders)]
    # The path of one step names files under paratrain/ without the prefix.
    steps = re.findall(r"^\s*\d+\. (.*)$", prose(text), flags=re.M)
    missing += [p for p in re.findall(r"`([\w/]+\.py)`", "\n".join(steps)) if not (ROOT / "paratrain" / p).is_file()]
    full = re.findall(r"\bparatrain/[\w/]+\.py\b", text)
    assert len(full) >= 10, "the 'where to look' table names files by their full path"
    missing += [p for p in full if not (ROOT / p).is_file()]
    assert missing == [], f"architecture.md names files that do not exist: {missing}"


def test_every_python_name_the_pages_give_resolves():
    """`paratrain.x.y` in a page is a module, or an attribute of one, that imports."""
    unresolved = []
    for page in PAGES:
        for dotted in sorted(set(re.findall(r"`(paratrain(?:\.\w+)+)", page.read_text()))):
            parts = dotted.split(".")
            for i in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                except ModuleNotFoundError:
                    continue
                try:
                    for attr in parts[i:]:
                        obj = getattr(obj, attr)
                except AttributeError:
                    unresolved.append(f"{page.name}: {dotted}")
                break
    assert unresolved == []


def _options(parser: argparse.ArgumentParser) -> set[str]:
    names = {s for action in parser._actions for s in action.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                names |= _options(sub)
    return names


def test_every_option_the_pages_name_is_one_of_paratrains_commands():
    known = _options(build_parser()) | FOREIGN_OPTIONS
    unknown = []
    for page in PAGES:
        text = page.read_text()
        commands = [line for block in code_blocks(text) for line in block.splitlines() if "paratrain" in line]
        for option in set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", prose(text) + "\n".join(commands))):
            if option not in known:
                unknown.append(f"{page.name}: {option}")
    assert sorted(unknown) == []


def test_ci_runs_the_readmes_test_command_verbatim():
    command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    blocks = [b.strip() for b in code_blocks((ROOT / "README.md").read_text())]
    assert command in blocks, f"the README's quick start has lost .ci/run's command: {command}"
    assert "pip install torch==2.13.0 && pip install -e . && paratrain train" in blocks
