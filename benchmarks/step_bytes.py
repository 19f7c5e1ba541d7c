"""Bytes of the messages one lap sends, as ``protocol.messages.encode`` writes them (msgpack, before
libp2p framing), for the figures the README and docs/protocol.md quote.

Sizes depend on the values, not only the field count: msgpack writes an id below 2^16 in 3
bytes and one above in 5, so SmolLM2's ids (vocabulary 49,152) and a 128k vocabulary differ, as
do small and large run ids and positions. Sampling parameters go on a session's first Step only
(and again when they change; client/_remote_session.py), so they are a once-per-session cost.
Deterministic: no timings. Run: python -m benchmarks.step_bytes
"""

from __future__ import annotations

from protocol.messages import Cancel, SamplingParams, Step, StepResult, encode

SESSION_ID = "0123456789abcdef"  # the client's session ids are 16 hex digits (secrets.token_hex(8))
SMOLLM2_ID, LLAMA3_ID = 1234, 128_000
PLACES = {"early (run 1, position 10)": (1, 10), "later (run 1,000, position 5,000)": (1000, 5000)}
SAMPLING = {
    "top-k 50, seed 7": SamplingParams(do_sample=True, top_k=50, seed=7),
    "top-k 50, seed 2^31": SamplingParams(do_sample=True, top_k=50, seed=2**31),
    "temperature 0.8, top-p 0.9, seed 1234": SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, seed=1234),
}


def step_bytes(drafts: int, token_id: int, run_id: int, start_pos: int, sampling=None) -> int:
    step = Step(
        session_id=SESSION_ID,
        run_id=run_id,
        start_pos=start_pos,
        token_ids=[token_id] * (1 + drafts),
        n_draft=drafts,
        sampling=sampling,
    )
    return len(encode(step))


def main() -> None:
    print("Greedy chain Step (one committed id + drafts), bytes:")
    print(f"{'':52}{'0 drafts':>10}{'4 drafts':>10}{'8 drafts':>10}")
    for place, (run_id, start_pos) in PLACES.items():
        for vocab, token_id in (("SmolLM2 ids", SMOLLM2_ID), ("128k-vocab ids", LLAMA3_ID)):
            sizes = [step_bytes(d, token_id, run_id, start_pos) for d in (0, 4, 8)]
            print(f"{place + ', ' + vocab:52}" + "".join(f"{n:>10}" for n in sizes))
    greedy = step_bytes(8, SMOLLM2_ID, 1, 10)
    print("Sampling parameters on a session's first Step (8 drafts, early), bytes added:")
    for name, params in SAMPLING.items():
        print(f"  {name:40}{step_bytes(8, SMOLLM2_ID, 1, 10, params) - greedy:>4}")
    result = StepResult(
        session_id=SESSION_ID, run_id=1, accepted=3, next_token=SMOLLM2_ID, step_digest=0x89ABCDEF
    )  # a real verdict names its Step
    print(f"StepResult (greedy verdict, no drafts or logprobs): {len(encode(result))}")
    print(f"Cancel: {len(encode(Cancel(session_id=SESSION_ID, run_id=100)))}")


if __name__ == "__main__":
    main()
