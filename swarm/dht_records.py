"""Writing and reading server records in the DHT (see :mod:`swarm.records` for the schema).

Both run inside hivemind's DHT process through ``DHT.run_coroutine``, so one call stores or reads
every block key of a span at once instead of one round trip per block.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Optional, Sequence

import msgspec
from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from swarm.records import MODELS_KEY, ServerInfo, block_key

logger = logging.getLogger(__name__)


def announce(
    dht: DHT, info: ServerInfo, expiration: float, wait: bool = True, num_blocks: Optional[int] = None
) -> Any:
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


def fetch_servers(dht: DHT, model: str, num_blocks: int, latest: bool = True) -> list[ServerInfo]:
    """Every valid, unexpired record of ``model``; one entry per server (not per block).

    A server that changed its span (a move, a second choice while joining) leaves its older
    record under the blocks it left until that expires, so the newest record wins: the one that
    expires last (every announcement of a server lives equally long)."""
    keys = [block_key(model, block) for block in range(num_blocks)]
    found = dht.run_coroutine(partial(_get_many, keys=keys, latest=latest))
    servers: dict[str, tuple[float, ServerInfo]] = {}
    for key in keys:
        entry = found.get(key)
        if entry is None or not isinstance(entry.value, dict):
            continue
        for subkey, item in entry.value.items():
            info = _parse(subkey, item.value, model)
            expires = getattr(item, "expiration_time", None)
            expires = expires if isinstance(expires, (int, float)) else float("-inf")
            if info is not None and (info.peer_id not in servers or expires >= servers[info.peer_id][0]):
                servers[info.peer_id] = (expires, info)
    return [info for _, info in servers.values()]


async def _get_many(dht: DHT, node: DHTNode, keys: Sequence[str], latest: bool) -> dict:
    sufficient = float("inf") if latest else None  # latest: keep searching for the freshest value
    return await node.get_many(keys, sufficient_expiration_time=sufficient, num_workers=8)


def fetch_models(dht: DHT) -> list[str]:
    return sorted(fetch_model_registry(dht))


def fetch_model_registry(dht: DHT) -> dict[str, Optional[int]]:
    """Model name -> its number of blocks, for every model some server announced recently
    (``None`` where the announcing server was too old to say)."""
    entry = dht.get(MODELS_KEY, latest=True)
    if entry is None or not isinstance(entry.value, dict):
        return {}
    registry: dict[str, Optional[int]] = {}
    for name, item in entry.value.items():
        value = getattr(item, "value", None)
        num_blocks = value.get("num_blocks") if isinstance(value, dict) else None
        valid = isinstance(num_blocks, int) and not isinstance(num_blocks, bool) and num_blocks > 0
        registry[str(name)] = num_blocks if valid else None
    return registry


def _parse(subkey: Any, value: Any, model: str) -> ServerInfo | None:
    """A record that does not validate, or that claims another peer id, is ignored (and logged)."""
    try:
        info = ServerInfo.from_dict(value)
    except (msgspec.ValidationError, TypeError) as e:
        logger.debug(f"Ignoring malformed record from {subkey}: {e}")
        return None
    if info.peer_id != subkey or info.model != model:
        logger.debug(f"Ignoring record under subkey {subkey} that claims peer {info.peer_id}")
        return None
    return info
