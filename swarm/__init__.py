"""Membership, routing and entry points of a specswarm swarm.

``from swarm import AutoDistributedModel`` is the public client API (``AutoDistributedModelForCausalLM``
is the same class under transformers' naming). Both are re-exported lazily (PEP 562) because
client/ itself imports swarm's DHT and routing modules; importing it eagerly here would make every
``python -m swarm.server`` load the client too.
"""

from typing import Any

__all__ = ["AutoDistributedModel", "AutoDistributedModelForCausalLM"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import client

        return getattr(client, name)
    raise AttributeError(f"module 'swarm' has no attribute {name!r}")
