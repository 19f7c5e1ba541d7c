"""Draw `make bench-wan`'s tokens/s against hop delay, one line per mode and one panel per workload.

    python -m benchmarks.wan_plot benchmarks/results/wan_heldout.json docs/wan_heldout.png

So a reader sees where speculation pays: at 0 ms the drafts' compute is all there is, and each
millisecond per hop makes a lap dearer, which accepted tokens per lap divide. Reads the JSON that
benchmarks/wan.py writes (its ``rows``: median tokens/s per delay, workload and mode). Needs
matplotlib (``pip install -e '.[plot]'``; the tests do not).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot(result_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    result = json.loads(result_path.read_text())
    rows = result["rows"]
    names = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, workload in zip(axes[0], names):
        mine = [r for r in rows if r["workload"] == workload]
        for mode in dict.fromkeys(r["mode"] for r in mine):
            points = sorted((r["delay_ms"], r["tokens_per_s"]) for r in mine if r["mode"] == mode)
            ax.plot([d for d, _ in points], [t for _, t in points], marker="o", label=mode)
        ax.set_title(workload)
        ax.set_xlabel("delay per hop (ms)")
        ax.set_ylabel("tokens/s (median)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    servers, commit = result.get("args", {}).get("servers", "?"), result.get("commit", "?")
    fig.suptitle(f"SmolLM2-135M, {servers} servers on loopback behind delay proxies; commit {commit}")
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", type=Path)
    p.add_argument("png", type=Path)
    args = p.parse_args()
    plot(args.result, args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
