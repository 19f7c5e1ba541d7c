"""Which started processes are forked warm and which start a fresh interpreter (swarm/warm_start.py).

A child asked for another value of a variable the libraries read at import must start cold (it would
not see the value otherwise); any other child must start warm, or every server costs 5-10 s of CPU in
imports. That was broken by variables nobody asked for: pytest's PYTEST_CURRENT_TEST, TORCHINDUCTOR_CACHE_DIR,
which importing torch._dynamo sets in this process (and in the forkserver), KMP_DUPLICATE_LIB_OK and
KMP_INIT_AT_FORK, which importing sklearn sets, and HF_XET_HIGH_PERFORMANCE, which importing lm_eval sets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from swarm import lifeline, warm_start

REPORT = "tests.kit.report_start"
ROOT = Path(__file__).resolve().parents[2]
# what late imports set: torch._dynamo the first, sklearn the KMP ones, lm_eval the last
LATE = ("TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "HF_XET_HIGH_PERFORMANCE")
# in a fresh interpreter: the forkserver starts before this process imports torch._dynamo, as in a test
# session whose first swarm starts before its first model is built
LATE_IMPORT = f"""
import json, os
from swarm import lifeline, warm_start
first = warm_start.run({REPORT!r}, [], env=lifeline.child_env(), timeout=120)
assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
import torch._dynamo
try:  # what the suite's tests of lm-eval import
    import lm_eval, sklearn
except ImportError:  # lm-eval is a dev dependency: the values they set
    os.environ.setdefault("HF_XET_HIGH_PERFORMANCE", "1")
    os.environ.setdefault("KMP_DUPLICATE_LIB_OK", "True")
    os.environ.setdefault("KMP_INIT_AT_FORK", "FALSE")
names = [{", ".join(repr(n) for n in LATE)}]
second = warm_start.run({REPORT!r}, names, env=lifeline.child_env(), timeout=120)
print(json.dumps([json.loads(first.stdout), json.loads(second.stdout), os.environ["TORCHINDUCTOR_CACHE_DIR"]]))
"""


def started(*names: str, env=None) -> dict:
    result = warm_start.run(REPORT, list(names), env=lifeline.child_env(env), timeout=120)
    assert result.returncode == 0, result.stderr
    return {**json.loads(result.stdout), "stderr": result.stderr}


def test_variables_this_processs_imports_set_after_the_forkserver_started_leave_the_child_warm():
    env = {k: v for k, v in os.environ.items() if k not in LATE}
    done = subprocess.run(
        [sys.executable, "-c", LATE_IMPORT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, second, cache_dir = json.loads(done.stdout.strip().splitlines()[-1])
    assert first["warm"]
    assert second["warm"], f"after the imports set {', '.join(LATE)}, a child started cold"
    assert second["env"] == {
        "TORCHINDUCTOR_CACHE_DIR": cache_dir,
        "KMP_DUPLICATE_LIB_OK": "True",
        "KMP_INIT_AT_FORK": "FALSE",
        "HF_XET_HIGH_PERFORMANCE": "1",
    }


def test_the_test_processs_own_environment_leaves_the_child_warm():
    report = started("PYTEST_CURRENT_TEST")
    assert report["warm"] and report["env"]["PYTEST_CURRENT_TEST"] == os.environ["PYTEST_CURRENT_TEST"]


def test_a_variable_read_at_import_set_to_another_value_starts_a_fresh_interpreter():
    report = started(
        "HF_HUB_OFFLINE", env={**os.environ, "HF_HUB_OFFLINE": "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1"}
    )
    assert not report["warm"]
    assert report["env"]["HF_HUB_OFFLINE"] != os.environ.get("HF_HUB_OFFLINE")
    assert "starts a fresh interpreter: HF_HUB_OFFLINE differ" in report["stderr"]  # the log says why


def test_a_variable_read_at_import_removed_starts_a_fresh_interpreter_without_it():
    env = {k: v for k, v in os.environ.items() if k != "HOME"}
    report = started("HOME", env=env)
    assert not report["warm"] and report["env"]["HOME"] is None


def test_any_other_variable_reaches_a_warm_child():
    report = started("SPECSWARM_SOMETHING", env={**os.environ, "SPECSWARM_SOMETHING": "42"})
    assert report["warm"] and report["env"]["SPECSWARM_SOMETHING"] == "42"
