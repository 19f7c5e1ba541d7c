"""The researcher's library: a transformers-style model whose blocks run in the swarm."""

from client._stats import GenerationStats
from client.classification import AutoDistributedModelForSequenceClassification
from client.errors import (
    GenerationError,
    RouteFault,
    RoutingError,
    ServerError,
    ServerRejected,
    ServerTimeout,
    SwarmError,
    UnconfirmedOutputsError,
    UnconfirmedOutputsWarning,
    UnconfirmedTokensError,
    UnconfirmedTokensWarning,
)
from client.model import AutoDistributedModel, AutoDistributedModelForCausalLM

__all__ = [
    "AutoDistributedModel",
    "AutoDistributedModelForCausalLM",
    "AutoDistributedModelForSequenceClassification",
    "GenerationError",
    "GenerationStats",
    "RouteFault",
    "RoutingError",
    "ServerError",
    "ServerRejected",
    "ServerTimeout",
    "SwarmError",
    "UnconfirmedOutputsError",
    "UnconfirmedOutputsWarning",
    "UnconfirmedTokensError",
    "UnconfirmedTokensWarning",
]
