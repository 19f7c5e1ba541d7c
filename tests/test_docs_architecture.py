"""docs/architecture.md stays true to the code: every module of the four packages has its line,
every ``file.py`` ``function`` the lap names exists in that file, and the picture was drawn from its
current graphviz source."""

from __future__ import annotations

import ast
import html
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("protocol", "server", "client", "swarm")
# `server/compute.py` `finish_run`, `client/_generation.py` `SpeculativeDecoder._lap`
NAMED = re.compile(r"`((?:protocol|server|client|swarm)/[\w/]+\.py)` `([A-Za-z_][\w.]*)`")


def _modules() -> set[str]:
    return {
        p.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if "__pycache__" not in p.parts
    }


def _defined(path: str) -> set[str]:
    """Top-level names and Class.method names defined in ``path``."""
    tree = ast.parse((ROOT / path).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {
                f"{node.name}.{item.name}"
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
    return names


def _stale(text: str) -> list[str]:
    stale = []
    for path, name in NAMED.findall(text):
        if not (ROOT / path).exists():
            stale.append(f"{path} (no such file)")
        elif name not in _defined(path):
            stale.append(f"{path} {name}")
    return stale


def test_every_module_has_its_line():
    text = DOC.read_text()
    missing = sorted(m for m in _modules() if f"- `{m}`:" not in text)
    assert not missing, f"modules without a line in docs/architecture.md's Packages: {missing}"


def test_every_listed_module_exists():
    listed = set(re.findall(r"^- `((?:protocol|server|client|swarm)/[\w/]+\.py)`:", DOC.read_text(), re.M))
    assert listed <= _modules(), f"docs/architecture.md lists modules that are gone: {sorted(listed - _modules())}"


def test_every_named_function_exists():
    assert len(NAMED.findall(DOC.read_text())) > 30  # the lap names its steps
    assert not _stale(DOC.read_text())


def test_a_renamed_function_is_caught():
    assert _stale("`server/compute.py` `finish_run` and `server/compute.py` `compute_run`") == [
        "server/compute.py compute_run"
    ]


def test_the_picture_is_drawn_from_its_source():
    """Every label line of architecture.dot is in architecture.svg: rerun dot after editing the source."""
    dot = (ROOT / "docs" / "architecture.dot").read_text()
    svg = html.unescape((ROOT / "docs" / "architecture.svg").read_text())
    lines = {part for label in re.findall(r'label="([^"]*)"', dot) for part in label.split("\\n")}
    missing = sorted(line for line in lines if line.strip() and line.strip() not in svg)
    assert not missing, f"docs/architecture.svg is older than docs/architecture.dot: {missing}"
