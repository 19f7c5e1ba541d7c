"""docs/server.md and ``python -m swarm.server --help`` name the same flags.

A flag added to the parser without a line in docs/server.md fails here, and so does a flag the
page names that the parser no longer takes (a rename the docs missed).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from swarm.server import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "server.md"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _parser_flags() -> set[str]:
    return {opt for action in build_parser()._actions for opt in action.option_strings if opt.startswith("--")}


def _documented_flags() -> set[str]:
    return set(FLAG.findall(DOC.read_text()))


def test_help_runs_and_lists_the_parsers_flags():
    """The real command line: ``--help`` exits 0 and shows every flag the parser object has."""
    out = subprocess.run(
        [sys.executable, "-m", "swarm.server", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr
    shown = set(FLAG.findall(out.stdout))
    assert shown == _parser_flags()


def test_every_flag_is_documented():
    missing = _parser_flags() - _documented_flags()
    assert not missing, f"flags of python -m swarm.server --help missing from docs/server.md: {sorted(missing)}"


def test_every_documented_flag_exists():
    """Flags of the other commands the page shows (swarm.bootstrap, swarm.local) are allowed by name."""
    others = {"--servers", "--index-url"}
    unknown = _documented_flags() - _parser_flags() - others
    assert not unknown, f"docs/server.md names flags python -m swarm.server does not take: {sorted(unknown)}"


def test_the_checks_catch_a_missing_and_a_stale_flag():
    """The comparison itself: a parser with one flag more, or a page naming one flag too many, fails."""
    parser = build_parser()
    parser.add_argument("--not-documented-anywhere")
    flags = {opt for action in parser._actions for opt in action.option_strings if opt.startswith("--")}
    assert "--not-documented-anywhere" in flags - _documented_flags()
    assert "--gone-flag" in set(FLAG.findall(DOC.read_text() + " `--gone-flag`")) - _parser_flags()
