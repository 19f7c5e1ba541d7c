"""The one rule of the layout (docs/design.md, "Layout"): every import runs down.

protocol/ is the ground every peer shares and imports none of ours; server/ and client/ are the two
roles and stand only on protocol/; swarm/ holds the programs and may import all three. The test walks
the syntax tree of every module, so a lazy import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("protocol", "server", "client", "swarm")
ALLOWED = {
    "protocol": {"protocol"},
    "server": {"protocol", "server"},
    "client": {"protocol", "client"},
    "swarm": {"protocol", "server", "client", "swarm"},
}


def imported_packages(path: Path) -> set[tuple[int, str]]:
    """(line, top-level package) of every absolute import of one of our packages in a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {(node.lineno, name.split(".")[0]) for name in names if name.split(".")[0] in OURS}
    return found


def test_imports_run_down():
    wrong = []
    for package in OURS:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, target in sorted(imported_packages(path)):
                if target not in ALLOWED[package]:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}/")
    assert not wrong, "imports that run against the layout:\n" + "\n".join(wrong)


@pytest.mark.parametrize("source,expected", [
    ("import server.span_server", {(1, "server")}),
    ("def f():\n    from client import model", {(2, "client")}),
    ("from . import sibling\nimport torch", set()),
])  # fmt: skip
def test_the_walker_sees_every_kind_of_import(tmp_path, source, expected):
    module = tmp_path / "m.py"
    module.write_text(source)
    assert imported_packages(module) == expected
