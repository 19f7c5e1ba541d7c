"""Handing a TrainDrop (abandoned training steps, docs/design.md "Long rows in chunks") to one hop of its route:
the client hands it to the route's head and each hop passes it on the same way, trying the hop after one that
does not take it (a dead hop is a common reason for a drop)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hivemind.p2p import PeerID

from protocol import relay
from protocol.messages import Hop, TrainDrop
from protocol.streams import TRAIN_PROTOCOL, MessageStream

logger = logging.getLogger(__name__)

DROP_TIMEOUT = 5.0  # seconds a hop has to take a drop before the hop after it is tried


async def hand_drop(p2p: Any, message: TrainDrop, hop: Hop) -> bool:
    """Send ``message`` to ``hop``; whether it answered in kind within DROP_TIMEOUT."""
    relay.remember(hop.peer_id, hop.addrs)
    stream = None
    try:
        stream = await asyncio.wait_for(
            MessageStream.open(p2p, PeerID.from_base58(hop.peer_id), TRAIN_PROTOCOL), DROP_TIMEOUT
        )
        await stream.send(message, [])
        received = await asyncio.wait_for(stream.receive(), DROP_TIMEOUT)
        return received is not None and isinstance(received.message, TrainDrop)
    except Exception as e:  # noqa: BLE001 - unreachable or silent: the caller tries the hop after it
        logger.info(f"Could not hand a training drop to {hop.peer_id}: {e!r}")
        return False
    finally:
        if stream is not None:
            stream.close()
