"""A generation as an asyncio stream of laps, for a caller on its own event loop.

``AutoDistributedModel.agenerate_stream`` yields one :class:`GeneratedChunk` per lap: the decoder
runs on the client loop (client/_loop.py) and each lap's tokens cross to the caller's loop through
a :class:`client._loop.Relay`, so many streams (e.g. the OpenAI gateway's requests) can run on one
model without ever touching the swarm's connections from another loop.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Optional

from client._adapters import with_adapter
from client._generation import GenerationStats, SpeculativeDecoder
from client._loop import Relay
from protocol.messages import TokenLogprobs


@dataclass
class GeneratedChunk:
    """One lap's output from ``agenerate_stream``: the tokens it accepted (several with speculation),
    their log-probs when asked for, and the generation's running stats (final once the stream ends)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    stats: GenerationStats
    # tokens yielded earlier that this chunk replaces: drop that many from the end of what you have,
    # then append token_ids (a spot-check caught a server of the route lying, and the tokens it may
    # have corrupted were re-verified on an honest route: docs/reliability.md, "Spot-checks")
    retracted: int = 0


def stream_laps(
    make_decoder: Callable[[Callable[[list[int]], None]], SpeculativeDecoder],
    row: list[int],
    max_new_tokens: int,
    with_logprobs: bool,
    close: Callable[[], Awaitable[None]],
    adapter: Optional[str] = None,
) -> AsyncIterator[GeneratedChunk]:
    """Decode ``row`` on the client loop and yield each lap's tokens on the caller's loop (call it
    there). ``make_decoder(on_tokens)`` builds the decoder; ``close()`` closes its session, always,
    before the stream ends (also when the reader stops early: close the stream with ``aclose()``).
    ``adapter``: the stream's LoRA adapter (client/_adapters.py), set in the task that decodes."""
    laps: Relay[GeneratedChunk] = Relay()
    retracted = [0]  # tokens_retracted already reported

    def on_tokens(new: list[int]) -> None:  # on the client loop
        gone, retracted[0] = decoder.stats.tokens_retracted - retracted[0], decoder.stats.tokens_retracted
        logprobs = decoder.logprobs[-len(new) :] if with_logprobs else []
        laps.post(GeneratedChunk(new, logprobs, decoder.stats, gone))

    decoder = make_decoder(on_tokens)
    work = functools.partial(decoder.generate, row, max_new_tokens)
    return laps.stream(functools.partial(with_adapter, adapter, work), close)
