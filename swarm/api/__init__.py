"""An OpenAI-compatible HTTP gateway to the swarm: ``python -m swarm.api --initial-peers MADDR ...``.

Existing tools (the official ``openai`` client, LangChain, editors, agents) talk to the swarm
unchanged: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``, with
``stream=true`` as server-sent events; batches of prompts, ``n``, and prompt log-probs (``echo``) as
evaluation harnesses send them; vLLM's ``/tokenize``, ``/detokenize``, ``/tokenizer_info``. See docs/api.md.

In code: ``runner, url = await start_server(Gateway({"smollm2-135m": model}), port=0)``.
"""

from swarm.api.app import Gateway, GatewayConfig, start_server

__all__ = ["Gateway", "GatewayConfig", "start_server"]
