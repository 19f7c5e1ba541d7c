"""Membership, routing and entry points of a specswarm swarm.

``from swarm import AutoDistributedModelForCausalLM`` is the public client API. It is re-exported
lazily (PEP 562) because client/ itself imports swarm's DHT and routing modules; importing it
eagerly here would make every ``python -m swarm.server`` load the client too.
"""

from typing import Any

__all__ = ["AutoDistributedModelForCausalLM"]


def __getattr__(name: str) -> Any:
    if name == "AutoDistributedModelForCausalLM":
        from client import AutoDistributedModelForCausalLM

        return AutoDistributedModelForCausalLM
    raise AttributeError(f"module 'swarm' has no attribute {name!r}")
