"""The two-process suite runner (tests/kit/shards.py): how files are dealt and how exit codes combine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.kit import shards
from tests.kit.shard_weights import DEFAULT_WEIGHT, FILE_SECONDS
from tests.kit.shards import SECONDS_FILE, FileSeconds, weights_from_log


def test_every_file_goes_to_exactly_one_shard_and_the_loads_are_close():
    files = sorted(FILE_SECONDS) + ["tests/unknown/test_new.py"]
    owner = shards.assign(files, 2)
    assert set(owner) == set(files) and set(owner.values()) == {1, 2}
    loads = [sum(FILE_SECONDS.get(f, DEFAULT_WEIGHT) for f in files if owner[f] == s) for s in (1, 2)]
    # longest-first dealing ends within the largest single file of each other
    assert abs(loads[0] - loads[1]) <= max(FILE_SECONDS.values())
    assert shards.assign(reversed(files), 2) == owner  # the order files are collected in does not matter


def test_a_run_with_fewer_files_than_shards_leaves_a_shard_empty():
    assert shards.assign(["tests/test_layout.py"], 3) == {"tests/test_layout.py": 1}


@pytest.mark.parametrize("value", ["", "0/2", "3/2", "1-2", "a/b"])
def test_a_bad_shard_value_is_an_error_naming_the_variable(value):
    with pytest.raises(ValueError, match=shards.ENV):
        shards.parse(value)


@pytest.mark.parametrize(
    "codes, expected",
    [([0, 0], 0), ([0, 1], 1), ([2, 1], 2), ([0, 5], 0), ([5, 5], 5), ([5, 1], 1)],
)
def test_exit_codes_combine_and_no_tests_fails_only_when_no_shard_ran_one(codes, expected):
    assert shards.combined_exit_code(codes) == expected


def test_every_run_leaves_its_per_file_seconds_for_the_next_deal(tmp_path):
    """tests/conftest.py adds every report's duration (setup, call, teardown) to its file and writes them when
    the session ends; ``--weights`` reads them back as FILE_SECONDS."""
    seconds = FileSeconds()
    reports = [("tests/a/test_x.py::t[1]", 1.0), ("tests/a/test_x.py::t[2]", 2.5), ("tests/test_y.py::u", 0.5)]
    for nodeid, duration in reports:
        seconds.add(SimpleNamespace(nodeid=nodeid, duration=duration))
    seconds.write(tmp_path)
    assert weights_from_log(tmp_path / SECONDS_FILE) == {"tests/a/test_x.py": 3.5, "tests/test_y.py": 0.5}
    FileSeconds().write(tmp_path / "nothing")  # a run that ran nothing writes nothing (and needs no folder)


def test_the_recap_keeps_each_shards_failures_and_final_count_only():
    import io
    import threading

    out = io.StringIO(
        "tests/a.py::test_x PASSED\n"
        "FAILED tests/hostile/test_sybils.py::test_y - AssertionError: 3 != 4\n"
        "ERROR tests/api/test_api.py::test_z - Failed: Timeout >240.0s\n"
        "= 1 failed, 1 error, 30 passed, 2 skipped in 812.10s (0:13:32) =\n"
        "some FAILED word mid-line\n"
    )
    recap: list[str] = []
    shards._pump(out, "[1/2] ", threading.Lock(), recap)
    assert recap == [
        "[1/2] FAILED tests/hostile/test_sybils.py::test_y - AssertionError: 3 != 4",
        "[1/2] ERROR tests/api/test_api.py::test_z - Failed: Timeout >240.0s",
        "[1/2] = 1 failed, 1 error, 30 passed, 2 skipped in 812.10s (0:13:32) =",
    ]


def test_failed_ids_come_from_the_recap_once_each_in_order():
    recap = [
        "[2/2] FAILED tests/hostile/test_sybils.py::test_y[greedy] - AssertionError: 3 != 4",
        "[1/2] ERROR tests/api/test_api.py::test_z - Failed: Timeout >240.0s",
        "[1/2] = 1 failed, 1 error, 30 passed in 812.10s (0:13:32) =",
        "[2/2] FAILED tests/hostile/test_sybils.py::test_y[greedy]",
    ]
    assert shards.failed_ids(recap) == ["tests/hostile/test_sybils.py::test_y[greedy]", "tests/api/test_api.py::test_z"]


def test_a_test_that_fails_beside_the_other_shard_and_passes_alone_is_flaky_not_a_failure(tmp_path, monkeypatch):
    """Two shards over a folder of three tests: one passes, one always fails, one fails only on its first
    run (it leaves a mark): the run fails while the always-failing test is there, and passes, naming the
    flaky one, without it."""
    import subprocess
    import sys

    mark = tmp_path / "ran-once"
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "test_a.py").write_text("def test_ok():\n    pass\n")
    (folder / "test_b.py").write_text(
        "from pathlib import Path\n"
        f"MARK = Path({str(mark)!r})\n"
        "def test_flaky():\n"
        "    first = not MARK.exists()\n"
        "    MARK.write_text('x')\n"
        "    assert not first, 'fails on its first run only'\n"
    )
    (folder / "test_c.py").write_text("def test_broken():\n    assert False\n")
    script = (
        "import sys; from tests.kit import shards; "
        f"sys.exit(shards.run(2, ['-p', 'no:cacheprovider', '-q', '--rootdir', {str(folder)!r}, *sys.argv[1:]]))"
    )

    def run(*paths):
        done = subprocess.run([sys.executable, "-c", script, *paths], cwd=shards.ROOT, capture_output=True, text=True)
        return done.returncode, done.stdout

    code, out = run(str(folder))
    assert code == 1, out  # test_broken fails again on the rerun
    assert "rerunning the 2 failed test(s)" in out and "FLAKY" not in out
    mark.unlink()
    code, out = run(str(folder / "test_a.py"), str(folder / "test_b.py"))
    assert code == 0, out
    assert "FLAKY" in out and "test_b.py::test_flaky" in out
