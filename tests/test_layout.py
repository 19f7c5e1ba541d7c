"""The one rule of the layout (docs/design.md, "Layout"): every import runs down.

protocol/ is the ground every peer shares and imports none of ours; server/ and client/ are the two
roles and stand only on protocol/; swarm/ holds the programs and may import all three. Inside a
package the modules import each other one way too: no circle. Tests and benchmarks share code only
through the test kit (tests/kit/): a benchmark imports nothing else of tests/, and no test imports
benchmarks/. The tests walk the syntax tree of every module, so a lazy import inside a function, or
one for type checking only, counts as much as one at the top.
"""

from __future__ import annotations

import ast
import re
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


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """Which of ``modules`` (dotted names) a module imports; ``from pkg import submodule`` names the
    submodule only."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = {f"{node.module}.{alias.name}" for alias in node.names} & modules
            found |= subs if len(subs) == len(node.names) else subs | {node.module}
    return found & modules


def import_circles(package: str) -> list[list[str]]:
    """Every circle of imports between the modules of ``package`` found by a depth-first walk."""
    paths = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (ROOT / package).rglob("*.py")
    }
    graph = {name: module_imports(path, set(paths)) - {name} for name, path in paths.items()}
    circles, state, stack = [], {}, []

    def walk(module: str) -> None:
        state[module], stack[len(stack) :] = "open", [module]
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                circles.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                walk(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            walk(module)
    return circles


@pytest.mark.parametrize("package", OURS)
def test_no_import_circle(package):
    circles = import_circles(package)
    assert not circles, "imports that run in a circle:\n" + "\n".join(" -> ".join(c) for c in circles)


def imported_modules(path: Path) -> set[tuple[int, str]]:
    """(line, dotted name) of every absolute import in a module; ``from a import b`` gives both
    ``a`` and ``a.b`` (b may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {(node.lineno, alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {(node.lineno, node.module)} | {(node.lineno, f"{node.module}.{a.name}") for a in node.names}
    return found


def kit_violations(root: Path) -> list[str]:
    """Imports under ``root`` that cross between tests/ and benchmarks/ other than through
    tests/kit/, one per import statement."""
    wrong = {}
    for path in sorted((root / "benchmarks").rglob("*.py")):
        for line, name in sorted(imported_modules(path)):
            shared = name in ("tests", "tests.kit") or name.startswith("tests.kit.")
            if name.split(".")[0] == "tests" and not shared:
                wrong.setdefault((path, line), f"imports {name} (only tests.kit is shared)")
    for path in sorted((root / "tests").rglob("*.py")):
        for line, name in sorted(imported_modules(path)):
            if name.split(".")[0] == "benchmarks":
                wrong.setdefault((path, line), f"imports {name} (move what is shared into tests/kit/)")
    return [f"{path.relative_to(root)}:{line} {what}" for (path, line), what in wrong.items()]


def test_tests_and_benchmarks_share_only_the_kit():
    wrong = kit_violations(ROOT)
    assert not wrong, "imports between tests/ and benchmarks/ outside tests/kit/:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "in_benchmarks,in_tests,caught",
    [
        ("from tests.kit.routes import PreferredRoutes", "from tests.kit import records", 0),
        ("from tests.generation.test_exactness import PROMPT", "", 1),
        ("def f():\n    from tests import test_trust", "", 1),
        ("from tests.conftest import SERVER_ARGS", "", 1),
        ("", "import benchmarks.wan", 1),
        ("", "def f():\n    from benchmarks import netns", 1),
    ],
)
def test_the_kit_rule_sees_every_crossing(tmp_path, in_benchmarks, in_tests, caught):
    for folder, source in (("benchmarks", in_benchmarks), ("tests", in_tests)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "m.py").write_text(source)
    assert len(kit_violations(tmp_path)) == caught


@pytest.mark.parametrize(
    "source,expected",
    [
        ("import server.span_server", {(1, "server")}),
        ("def f():\n    from client import model", {(2, "client")}),
        ("from . import sibling\nimport torch", set()),
    ],
)
def test_the_walker_sees_every_kind_of_import(tmp_path, source, expected):
    module = tmp_path / "m.py"
    module.write_text(source)
    assert imported_packages(module) == expected


def drawn_edges(dot: str) -> set[tuple[str, str]]:
    """The `a -> b;` edges of a dot file."""
    return set(re.findall(r"^\s*(\w+)\s*->\s*(\w+)\s*;", dot, flags=re.MULTILINE))


def test_the_import_drawing_is_the_code():
    """docs/imports.svg is rendered from docs/imports.dot; its edges must be the imports the code has."""
    actual = set()
    for package in OURS:
        for path in (ROOT / package).rglob("*.py"):
            actual |= {(package, target) for _, target in imported_packages(path) if target != package}
    drawn = drawn_edges((ROOT / "docs" / "imports.dot").read_text())
    assert drawn == actual, f"drawn but not imported: {drawn - actual}; imported but not drawn: {actual - drawn}"
    assert "<svg" in (ROOT / "docs" / "imports.svg").read_text()


MAX_LINES = 450  # one job per file: hivemind's and Petals' files sit well under it (issue 34)


def long_files(root: Path) -> list[str]:
    folders = [root / package for package in OURS] + [root / "tests" / "kit"]
    return [
        f"{path.relative_to(root)}: {n} lines"
        for folder in folders
        for path in sorted(folder.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]


def test_no_file_is_over_the_line_limit():
    wrong = long_files(ROOT)
    assert not wrong, f"files over {MAX_LINES} lines (split them by job):\n" + "\n".join(wrong)


def test_the_line_limit_sees_a_long_file(tmp_path):
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "server" / "short.py").write_text("x = 1\n" * MAX_LINES)
    assert long_files(tmp_path) == [f"server/long.py: {MAX_LINES + 1} lines"]
