"""The programs people run (server CLI, bootstrap, local launcher, gateway, dashboard, delay proxy)
and the public face of the library.

``from swarm import AutoDistributedModel`` is the public client API (``AutoDistributedModelForCausalLM``
is the same class under transformers' naming; ``AutoDistributedModelForSequenceClassification`` adds a
trainable ``score`` head). All are re-exported lazily (PEP 562) only so that
``python -m swarm.server`` does not load the client library it never uses.
"""

from typing import Any

__all__ = ["AutoDistributedModel", "AutoDistributedModelForCausalLM", "AutoDistributedModelForSequenceClassification"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import client

        return getattr(client, name)
    raise AttributeError(f"module 'swarm' has no attribute {name!r}")
