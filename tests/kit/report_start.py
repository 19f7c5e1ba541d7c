"""``python -m tests.kit.report_start NAME...``: prints, as JSON, whether this process started warm
(forked from swarm/warm_start.py's forkserver, torch imported before this module ran) and the values of
the environment variables NAME... (null where unset); tests/server/test_warm_start.py reads it."""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    warm = "torch" in sys.modules  # a fresh `python -m` has not imported torch: this module does not
    print(json.dumps({"warm": warm, "env": {name: os.environ.get(name) for name in sys.argv[1:]}}))
