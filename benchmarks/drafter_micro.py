"""Per-lap CPU cost of the retrieval drafters: extend(1 token) + propose(16), and of hedging.

A lap over the WAN costs ~200 ms, so a drafter must cost well under 1 ms per lap. Each case
resets a drafter on a 4,000-token context, then times `LAPS` laps that each commit the next
token of the stream and ask for a 16-token draft; it prints the median and p99 in
microseconds, the reset time, and the mean draft length. "hedge us" is the median cost of the
outcome hedging the client does per lap while a run is in flight (what `client.modes.chain.ChainMode.hedge`
asks of the drafter: top-3 alternatives at each draft position and a 16-token draft past each,
at most 16). Run: python -m benchmarks.drafter_micro
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from client.drafting import Drafter, NgramDrafter, SuffixDrafter, SuffixStore

CONTEXT = 4000
LAPS = 2000
VOCAB = 32000


def repetitive(seed: int, length: int) -> list[int]:
    """Text-like ids: 70% of the time one of 40 recurring phrases, else a fresh token."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 30))] for _ in range(40)]
    out: list[int] = []
    while len(out) < length:
        out += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(VOCAB)]
    return out[:length]


def uniform(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def run(make: Callable[[], Drafter], stream: list[int]) -> tuple[float, ...]:
    """(median us, p99 us, reset ms, mean draft length, mean correct prefix, median hedge us)."""
    drafter = make()
    start = time.perf_counter()
    drafter.reset(stream[:CONTEXT])
    reset_ms = (time.perf_counter() - start) * 1e3
    laps, hedges, drafted, correct = [], [], 0, 0
    for i in range(CONTEXT, CONTEXT + LAPS):
        t0 = time.perf_counter_ns()
        drafter.extend(stream[i : i + 1])
        draft = drafter.propose(16)
        laps.append((time.perf_counter_ns() - t0) / 1e3)
        t0 = time.perf_counter_ns()
        hedge(drafter, draft)
        hedges.append((time.perf_counter_ns() - t0) / 1e3)
        drafted += len(draft)
        truth = stream[i + 1 : i + 1 + len(draft)]
        correct += next((j for j, (a, b) in enumerate(zip(draft, truth)) if a != b), len(truth))
    laps.sort()
    return (
        statistics.median(laps),
        laps[int(0.99 * len(laps))],
        reset_ms,
        drafted / LAPS,
        correct / LAPS,
        statistics.median(hedges),
    )


def hedge(drafter: Drafter, draft: list[int], width: int = 2, limit: int = 16) -> None:
    made = 0
    for j in range(len(draft) + 1):
        for token in drafter.alternatives(width + 1, after=draft[:j]):
            if (j < len(draft) and token == draft[j]) or made >= limit:
                continue
            drafter.draft(16, after=draft[:j] + [token])
            made += 1


def store_rebuild_ms() -> float:
    """Cost of the add that overflows a full default store (evict to 3/4, rebuild)."""
    store = SuffixStore()
    seed = 200
    while store.num_tokens + 1000 <= store.max_tokens:
        store.add(repetitive(seed, 1000))
        seed += 1
    start = time.perf_counter()
    store.add(repetitive(seed, 1000))
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    store = SuffixStore()
    for seed in range(100, 116):  # ~16K tokens of earlier outputs
        store.add(repetitive(seed, 1000))
    makers: dict[str, Callable[[], Drafter]] = {
        "suffix": lambda: SuffixDrafter(16),
        "suffix+store": lambda: SuffixDrafter(16, store=store),
        "ngram": lambda: NgramDrafter(16),
    }
    contexts = {
        "repetitive": repetitive(0, CONTEXT + LAPS + 16),
        "random": uniform(0, CONTEXT + LAPS + 16),
        "loop(period 1)": [7] * (CONTEXT + LAPS + 16),
    }
    print(f"{CONTEXT}-token context, {LAPS} laps of extend(1) + propose(16), CPython")
    head = ("context", "drafter", "median us", "p99 us", "reset ms", "draft len", "correct", "hedge us")
    print(f"{head[0]:<16}{head[1]:<14}" + "".join(f"{h:>11}" for h in head[2:]))
    for cname, stream in contexts.items():
        for dname, make in makers.items():
            row = run(make, stream)
            print(f"{cname:<16}{dname:<14}" + "".join(f"{x:>11.2f}" for x in row))
    print(f"full store ({SuffixStore().max_tokens} tokens): overflowing add {store_rebuild_ms():.0f} ms")


if __name__ == "__main__":
    main()
