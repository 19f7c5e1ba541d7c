"""Writing and reading server records in the DHT (see :mod:`protocol.records` for the schema).

Both run inside hivemind's DHT process through ``DHT.run_coroutine``, so one call stores or reads
every block key of a span at once instead of one round trip per block.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Any, Callable, Mapping, Optional, Sequence

import msgspec
from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from protocol import relay
from protocol.records import (
    MAX_MODEL_BLOCKS,
    MAX_NAME_CHARS,
    MAX_PEER_ID_CHARS,
    MAX_REPORT_COUNT,
    MAX_REPORTED_PEERS,
    MAX_REPORTERS,
    MODELS_KEY,
    REPORT_EXPIRATION,
    ServerInfo,
    block_key,
    reports_key,
)
from protocol.validation import precision_problem

logger = logging.getLogger(__name__)

# Block keys one DHT lookup asks for. hivemind asks a peer about sqrt(keys) keys a request and the
# peer answers with every value it holds under them, each up to MAX_RECORD_BYTES (64 KB: a hostile
# record may be that large); past p2pd's 4 MiB a message hivemind sends no answer at all (its error
# reply fails to build), so the reader waits out its timeout and reads those keys as missing. All
# 61 keys in one lookup asked 7 a request, and with 1,000 servers (10% hostile) the readers stalled
# (docs/scale.md, "100 and 200 peers"); lookups of 8 keys ask 2 a request.
KEYS_PER_LOOKUP = 8


def announce(dht: DHT, info: ServerInfo, expiration: float, wait: bool = True, num_blocks: Optional[int] = None) -> Any:
    """Store ``info`` under each of its blocks' keys (subkey: its peer id) and the model registry
    (subkey: the model, value: its ``num_blocks``, so readers such as the dashboard know the
    block keys to read)."""
    keys = [block_key(info.model, block) for block in info.span] + [MODELS_KEY]
    subkeys: list[Any] = [info.peer_id] * len(info.span) + [info.model]
    values: list[Any] = [info.to_dict()] * len(info.span) + [{"num_blocks": num_blocks}]
    return dht.run_coroutine(
        partial(_store_many, keys=keys, subkeys=subkeys, values=values, expiration=expiration),
        return_future=not wait,
    )


async def _store_many(dht: DHT, node: DHTNode, keys, subkeys, values, expiration: float) -> dict:
    return await node.store_many(
        keys, values, expiration_time=get_dht_time() + expiration, subkeys=subkeys, num_workers=8
    )


def fetch_servers(
    dht: DHT,
    model: str,
    num_blocks: int,
    latest: bool = True,
    *,
    read_blocks: Optional[int] = None,
    blocks: Optional[Sequence[int]] = None,
) -> list[ServerInfo]:
    """Every valid, unexpired record of ``model``; one entry per server (not per block).

    ``num_blocks`` is the model's number of blocks, taken from its config (or, where a reader has
    no config, a number it capped at ``MAX_MODEL_BLOCKS``; never a claim read from the swarm):
    records whose span leaves ``0..num_blocks``, or whose fields fail the bounds of
    :class:`ServerInfo`, are dropped (logged at DEBUG). ``read_blocks`` reads only the keys of the
    first blocks (default: all ``num_blocks``); ``blocks`` only the keys of these blocks (those
    outside ``0..num_blocks`` skipped): a reader that needs two blocks' servers should not pay for
    a lookup of every block (each key is a full DHT search).

    A server that changed its span (a move, a second choice while joining) leaves its older
    record under the blocks it left until that expires, so the newest record wins: the one that
    expires last (every announcement of a server lives equally long)."""
    if not 0 < num_blocks <= MAX_MODEL_BLOCKS:
        raise ValueError(f"num_blocks must be in 1..{MAX_MODEL_BLOCKS}, got {num_blocks}")
    read = num_blocks if read_blocks is None else max(0, min(read_blocks, num_blocks))
    chosen = range(read) if blocks is None else sorted({b for b in blocks if 0 <= b < read})
    keys = [block_key(model, block) for block in chosen]
    if not keys:
        return []
    found = dht.run_coroutine(partial(_get_many, keys=keys, latest=latest))
    servers: dict[str, tuple[float, ServerInfo]] = {}
    for key in keys:
        entry = found.get(key)
        if entry is None or not isinstance(entry.value, dict):
            continue
        for subkey, item in entry.value.items():
            info = _parse(subkey, item.value, model, num_blocks)
            expires = getattr(item, "expiration_time", None)
            expires = expires if isinstance(expires, (int, float)) else float("-inf")
            if info is not None and (info.peer_id not in servers or expires >= servers[info.peer_id][0]):
                servers[info.peer_id] = (expires, info)
    return [info for _, info in servers.values()]


async def _get_many(dht: DHT, node: DHTNode, keys: Sequence[str], latest: bool) -> dict:
    """Every key's entry, looked up ``KEYS_PER_LOOKUP`` keys at a time, the lookups all at once."""
    sufficient = float("inf") if latest else None  # latest: keep searching for the freshest value
    groups = [keys[i : i + KEYS_PER_LOOKUP] for i in range(0, len(keys), KEYS_PER_LOOKUP)]
    found: dict = {}
    lookups = (node.get_many(group, sufficient_expiration_time=sufficient, num_workers=8) for group in groups)
    for entries in await asyncio.gather(*lookups):
        found.update(entries)
    return found


def fetch_model_registry(dht: DHT, known: Optional[Mapping[str, int]] = None) -> dict[str, Optional[int]]:
    """Model name -> its number of blocks, for every model some server announced recently
    (``None`` where the announcing server was too old to say, or said something invalid).

    Anyone can write the registry, so nothing in it is trusted beyond a bound: a name that is
    not a string of at most ``MAX_NAME_CHARS`` is skipped, a ``num_blocks`` that is not an int in
    ``1..MAX_MODEL_BLOCKS`` reads as ``None``, and for a model in ``known`` (name -> blocks from
    the model's own config) the config's number is used and a disagreeing entry ignored."""
    known = known or {}
    entry = dht.get(MODELS_KEY, latest=True)
    if entry is None or not isinstance(entry.value, dict):
        return {}
    registry: dict[str, Optional[int]] = {}
    for name, item in entry.value.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            logger.debug(f"Ignoring a registry entry with a bad model name ({type(name).__name__})")
            continue
        value = getattr(item, "value", None)
        num_blocks = value.get("num_blocks") if isinstance(value, dict) else None
        valid = isinstance(num_blocks, int) and not isinstance(num_blocks, bool) and 0 < num_blocks <= MAX_MODEL_BLOCKS
        if name in known:
            if num_blocks != known[name]:
                logger.debug(f"Ignoring registry entry {name}: {num_blocks!r} blocks, its config says {known[name]}")
            registry[name] = known[name]
        else:
            registry[name] = num_blocks if valid else None
    return registry


def publish_report(
    dht: DHT, model: str, counts: Mapping[str, int], expiration: float = REPORT_EXPIRATION, timeout: float = 30.0
) -> bool:
    """Store this peer's spot-check report for ``model`` (accused peer id -> times caught; the
    ``MAX_REPORTED_PEERS`` most caught), signed under its own peer id. Blocks at most ``timeout``
    seconds (a thread stuck on a DHT that is shutting down would hold up the interpreter's exit);
    True if stored."""
    top = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:MAX_REPORTED_PEERS]
    value = {peer: min(int(count), MAX_REPORT_COUNT) for peer, count in top if count > 0}
    stored = dht.store(
        reports_key(model), value, get_dht_time() + expiration, subkey=dht.peer_id.to_base58(), return_future=True
    )
    return bool(stored.result(timeout=timeout))


def fetch_reports(dht: DHT, model: str) -> dict[str, int]:
    """Accused peer id -> how many clients report it for ``model`` (spot-checks).

    The validator has checked that each entry is signed by the client its subkey names; the rest is
    bounded here: at most ``MAX_REPORTERS`` reports are counted, and a report that is not a dict of
    at most ``MAX_REPORTED_PEERS`` peer ids (strings) to positive ints is ignored whole."""
    entry = dht.get(reports_key(model), latest=True)
    if entry is None or not isinstance(entry.value, dict):
        return {}
    reporters: dict[str, int] = {}
    for counted, item in enumerate(entry.value.values()):
        if counted >= MAX_REPORTERS:
            break
        report = getattr(item, "value", None)
        if not _valid_report(report):
            logger.debug(f"Ignoring a malformed spot-check report under {reports_key(model)}")
            continue
        for peer in report:
            reporters[peer] = reporters.get(peer, 0) + 1
    return reporters


def _valid_report(report: Any) -> bool:
    return (
        isinstance(report, dict)
        and len(report) <= MAX_REPORTED_PEERS
        and all(isinstance(peer, str) and 0 < len(peer) <= MAX_PEER_ID_CHARS for peer in report)
        and all(isinstance(n, int) and not isinstance(n, bool) and 0 < n <= MAX_REPORT_COUNT for n in report.values())
    )


def _parse(subkey: Any, value: Any, model: str, num_blocks: int) -> ServerInfo | None:
    """A record that does not validate (fields out of bounds, a span outside the model's
    ``num_blocks``, a precision this project does not serve), or that claims another peer id, is
    ignored (and logged with the reason)."""
    try:
        info = ServerInfo.from_dict(value, num_blocks)
    except (msgspec.ValidationError, TypeError) as e:
        logger.debug(f"Ignoring malformed record from {str(subkey)[:64]}: {str(e)[:200]}")
        return None
    problem = precision_problem(info.dtype, info.quantization)
    if problem is not None:  # a precision nobody else announces: never audited (protocol.validation)
        logger.debug(f"Ignoring record from {str(subkey)[:64]}: {problem}")
        return None
    if info.peer_id != subkey or info.model != model:
        logger.debug(f"Ignoring record under subkey {str(subkey)[:64]} that claims peer {info.peer_id}")
        return None
    if info.relay_addrs:
        relay.remember(info.peer_id, info.relay_addrs)  # so streams to it go through its relays
    return info


def wait_until_online(
    dht: DHT, model: str, num_blocks: int, expected: int, timeout: float, check: Callable[[], None] = lambda: None
) -> None:
    """Block until ``expected`` servers of ``model`` are announced ONLINE; ``check`` runs before each
    read and may raise (a launcher checks that its server processes are still alive)."""
    from protocol.records import ServerState

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check()
        if sum(s.state == ServerState.ONLINE for s in fetch_servers(dht, model, num_blocks)) >= expected:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{expected} servers of {model} did not come online within {timeout:.0f} s")
