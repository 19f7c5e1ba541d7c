"""The researcher's library: a transformers-style model whose blocks run in the swarm."""

from client.errors import GenerationError, RoutingError, ServerError, ServerRejected, ServerTimeout, SwarmError
from client._stats import GenerationStats
from client.model import AutoDistributedModel, AutoDistributedModelForCausalLM

__all__ = [
    "AutoDistributedModel",
    "AutoDistributedModelForCausalLM",
    "GenerationError",
    "GenerationStats",
    "RoutingError",
    "ServerError",
    "ServerRejected",
    "ServerTimeout",
    "SwarmError",
]
