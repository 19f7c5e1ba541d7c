"""Where a server's model comes from: its config, read from a local folder or the hub, with a clear
error when neither answers, and for a hub model the commit to pin.

**Which commit.** Servers of one model must hold the same weights to be routed together (records
carry ``revision``; ``protocol.routing.same_model``). A hub repo's ``main`` moves, so a server that
pinned "main now" could join a swarm that serves last month's commit and serve nobody's route. A new
server of a hub model therefore adopts the commit the swarm's ``ONLINE`` servers announce
(:func:`adopt_swarm_revision`): with several, the one with the most served blocks (the sum of the
announcing servers' span lengths), named in the log; ``--revision`` given by the volunteer wins;
with no server of the model online (or only records without a hub commit) it is ``main``'s commit.
A commit that records announce but the hub cannot serve (a typo, a deleted branch, a record that
lies) falls back to ``main``, with a warning: a record can choose among real commits, never make a
server fail to start.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from typing import Optional, Sequence

import hivemind
from transformers import AutoConfig, PretrainedConfig

from protocol.dht_records import fetch_servers
from protocol.models import hub_commit
from protocol.records import ServerInfo, ServerState

logger = logging.getLogger(__name__)

_COMMIT = re.compile(r"[0-9a-f]{40}")  # a hub commit; a local folder's revision is "sha256:..."


def swarm_revision(servers: Sequence[ServerInfo]) -> Optional[str]:
    """The hub commit that ``ONLINE`` records announce with the most served blocks (ties: the
    smallest commit id, so every reader picks the same); None when no online record names one."""
    blocks: Counter[str] = Counter()
    for s in servers:
        if s.state == ServerState.ONLINE and _COMMIT.fullmatch(s.revision):
            blocks[s.revision] += len(s.span)
    if not blocks:
        return None
    best = min(blocks, key=lambda r: (-blocks[r], r))
    if len(blocks) > 1:
        counts = ", ".join(f"{r[:12]}: {n} blocks" for r, n in sorted(blocks.items(), key=lambda rn: (-rn[1], rn[0])))
        logger.info(f"The swarm serves several revisions ({counts}); taking {best[:12]}, which serves the most blocks")
    return best


def adopt_swarm_revision(dht: hivemind.DHT, dht_name: str, source: str) -> Optional[str]:
    """The commit of hub repo ``source`` a new server pins (module docstring): the swarm's
    (:func:`swarm_revision` over the records of ``dht_name``), else the hub's ``main``."""
    main = hub_commit(source)
    total = load_model_config(source, main).num_hidden_layers  # which block keys to read
    chosen = swarm_revision(fetch_servers(dht, dht_name, total))
    if chosen is None:
        logger.info(f"Revision of {source}: {main} (the hub's main; no server of it online announces one)")
        return main
    if chosen == main:
        logger.info(f"Revision of {source}: {chosen} (what the swarm serves, and the hub's main)")
        return chosen
    try:
        load_model_config(source, chosen)
    except ValueError as e:
        logger.warning(
            f"The swarm serves {source} at {chosen}, which the hub does not serve ({e}); taking the hub's main {main}"
        )
        return main
    logger.info(f"Revision of {source}: {chosen} (what the swarm serves; the hub's main is {main})")
    return chosen


def load_model_config(source: str, revision: Optional[str] = None) -> PretrainedConfig:
    """The model's config, or a ValueError naming the repo (or folder) that could not be read.

    Without network the hub client retries for half a minute before giving up; when the hub's host
    does not even resolve (or HF_HUB_OFFLINE is set) only the local cache is tried, so the server
    fails at once with a clear message instead of a stack trace.
    """
    local_only = not os.path.isdir(source) and not hub_reachable()
    try:
        return AutoConfig.from_pretrained(source, local_files_only=local_only, revision=revision)
    except Exception as e:  # OSError, huggingface_hub and httpx errors, unknown model types
        if local_only:
            reason = (
                "the Hugging Face hub is unreachable (no network, or HF_HUB_OFFLINE is set) "
                "and it is not in the local cache"
            )
        else:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load the config of {source!r}: {reason}") from None


def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the hub's host name resolves (a DNS lookup only: no connection is made)."""
    import socket
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    pool = ThreadPoolExecutor(1)
    try:
        pool.submit(socket.getaddrinfo, host, 443).result(timeout=timeout)
        return True
    except Exception:
        return False
    finally:
        pool.shutdown(wait=False)
