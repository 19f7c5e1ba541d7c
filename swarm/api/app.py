"""The aiohttp application: routes, API keys, the per-key concurrency limit, JSON and SSE replies.

A request, top to bottom (``Gateway._generate``):
  1) authenticate (``Authorization: Bearer KEY``, when keys are configured);
  2) parse and validate the body; find the model (400 / 404 before any swarm work);
  3) take one of the key's concurrency slots (429 when none is free);
  4) generate under the request's deadline; a streamed reply sends its headers with the first
     lap, so errors before any token (no route, timeout) still get their own HTTP status;
  5) a client that goes away cancels the request's task (aiohttp's handler cancellation, or
     the next failed write): the generation stops and its session closes on every server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Mapping, Optional, Union

import msgspec
from aiohttp import web

from client import AutoDistributedModelForCausalLM
from swarm.api.engine import DEFAULT_MAX_TOKENS, Delta, ServedModel, TextGeneration
from swarm.api.errors import APIError, from_exception
from swarm.api.responses import ChatFormat, CompletionFormat, speculation_headers
from swarm.api.schemas import ChatRequest, CompletionRequest, chat_params, completion_params, parse

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class GatewayConfig:
    api_keys: frozenset[str] = frozenset()  # empty: no authentication
    max_concurrent_per_key: int = 0  # requests in flight per API key (all requests share one key when
    #                                  no keys are configured); 0: unlimited
    request_timeout: float = 600.0  # seconds for a whole request, first token to last
    # a request without max_tokens generates at most this many (finish_reason "length" past it):
    # every hop reserves cache for prompt + max_tokens, so "up to the whole context" on every
    # request would let a few requests take every server's cache
    default_max_tokens: int = DEFAULT_MAX_TOKENS


class ConcurrencyLimiter:
    """Requests in flight per key; all on the event loop's thread, so a plain counter."""

    def __init__(self, limit: int):
        self.limit = limit
        self.active: Counter[str] = Counter()

    @contextlib.contextmanager
    def slot(self, key: str) -> Iterator[None]:
        if self.limit and self.active[key] >= self.limit:
            raise APIError(429, f"this API key already has {self.active[key]} requests in flight (limit "
                           f"{self.limit}); retry when one finishes", "rate_limit_error", code="concurrency_limit_exceeded")  # fmt: skip
        self.active[key] += 1
        try:
            yield
        finally:
            self.active[key] -= 1
            if not self.active[key]:
                del self.active[key]

    @property
    def total(self) -> int:
        return sum(self.active.values())


class Gateway:
    """Serves ``models`` (API name -> client-library model; the caller owns and shuts them down)."""

    def __init__(self, models: Mapping[str, AutoDistributedModelForCausalLM], config: GatewayConfig = GatewayConfig()):
        if not models:
            raise ValueError("the gateway needs at least one model to serve")
        self.models = {name: ServedModel(name, model, config.default_max_tokens) for name, model in models.items()}
        self.config = config
        self.limiter = ConcurrencyLimiter(config.max_concurrent_per_key)

    @property
    def requests_in_flight(self) -> int:
        return self.limiter.total

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._authenticate], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model}", self.get_model)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        return app

    # ---- middlewares -------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every failure leaves as OpenAI's error shape; tracebacks stay in the log."""
        try:
            return await handler(request)
        except APIError as e:
            return _error_response(e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            message = f"{e.reason}: {request.method} {request.path}" if e.status in (404, 405) else e.text or e.reason
            return _error_response(APIError(e.status, message, kind))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:
            return _error_response(from_exception(e))

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.config.api_keys and request.path.startswith("/v1/"):
            key = _bearer(request)
            if key is None or not any(hmac.compare_digest(key.encode(), k.encode()) for k in self.config.api_keys):
                raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                               "authentication_error", code="invalid_api_key")  # fmt: skip
        return await handler(request)

    # ---- routes ------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok", "models": sorted(self.models), "requests_in_flight": self.requests_in_flight})

    async def list_models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [_model_card(name) for name in self.models]})

    async def get_model(self, request: web.Request) -> web.Response:
        return _json(_model_card(self._served(request.match_info["model"]).name))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = parse(await request.read(), ChatRequest)
        served = self._served(req.model)
        params, shown = chat_params(req, served)
        generation = TextGeneration(served, params, buffered=not req.stream)
        return await self._generate(request, req, generation, ChatFormat(served, generation, shown))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse(await request.read(), CompletionRequest)
        served = self._served(req.model)
        params, shown = completion_params(req, served)
        generation = TextGeneration(served, params, buffered=not req.stream)
        return await self._generate(request, req, generation, CompletionFormat(served, generation, shown))

    def _served(self, name: str) -> ServedModel:
        served = self.models.get(name)
        if served is None:
            raise APIError(404, f"the model {name!r} does not exist on this gateway; it serves "
                           f"{', '.join(sorted(self.models))}", "not_found_error", param="model", code="model_not_found")  # fmt: skip
        return served

    # ---- generation --------------------------------------------------------------------------

    async def _generate(self, request: web.Request, req: Any, generation: TextGeneration,
                        fmt: Union[ChatFormat, CompletionFormat]) -> web.StreamResponse:  # fmt: skip
        with self.limiter.slot(_bearer(request) or ""):
            deadline = asyncio.get_running_loop().time() + self.config.request_timeout
            if req.stream:
                return await self._stream(request, generation, fmt, deadline, req.include_usage)
            deltas = []
            try:
                async with asyncio.timeout_at(deadline):
                    async with contextlib.aclosing(generation.deltas()) as stream:
                        async for delta in stream:
                            if delta.restart:  # a spot-check replaced tokens: this delta holds all of it
                                deltas.clear()
                            deltas.append(delta)
            except Exception as e:
                raise from_exception(e, generation.served.name) from None
            return _json(fmt.response(deltas), headers=speculation_headers(generation.stats))

    async def _stream(self, request: web.Request, generation: TextGeneration, fmt: Union[ChatFormat, CompletionFormat],
                      deadline: float, include_usage: bool) -> web.StreamResponse:  # fmt: skip
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        async with contextlib.aclosing(generation.deltas()) as stream:
            try:
                async with asyncio.timeout_at(deadline):
                    delta = await anext(stream, None)  # before the headers: early errors keep their status
            except Exception as e:
                raise from_exception(e, generation.served.name) from None
            await response.prepare(request)
            try:
                await self._send_chunks(response, stream, delta, fmt, deadline, include_usage)
                await response.write(b"data: [DONE]\n\n")
            except ConnectionResetError:  # leaving the block closes the stream: the generation stops
                logger.info("The client went away mid-stream; its generation is cancelled")
        return response

    async def _send_chunks(self, response: web.StreamResponse, stream: AsyncIterator[Delta], delta: Optional[Delta],
                           fmt: Union[ChatFormat, CompletionFormat], deadline: float, include_usage: bool) -> None:  # fmt: skip
        try:
            await _send(response, fmt.opening_chunk())
            async with asyncio.timeout_at(deadline):
                while delta is not None:
                    if fmt.wants_chunk(delta):
                        await _send(response, fmt.chunk(delta))
                    delta = await anext(stream, None)
        except ConnectionResetError:
            raise
        except Exception as e:  # the headers are sent: report in the stream, as OpenAI does
            await _send(response, from_exception(e, fmt.served.name).body())
            return
        await _send(response, fmt.closing_chunk())
        if include_usage:
            await _send(response, fmt.usage_chunk())


async def _send(response: web.StreamResponse, payload: Optional[dict[str, Any]]) -> None:
    if payload is not None:
        await response.write(b"data: " + msgspec.json.encode(payload) + b"\n\n")


def _json(body: Any, status: int = 200, headers: Optional[dict[str, str]] = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, headers=headers, content_type="application/json")


def _error_response(error: APIError) -> web.Response:
    return _json(error.body(), status=error.status)


def _bearer(request: web.Request) -> Optional[str]:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "specswarm"}


async def start_server(gateway: Gateway, host: str = "127.0.0.1", port: int = 0,
                       shutdown_grace: float = 5.0) -> tuple[web.AppRunner, str]:  # fmt: skip
    """Listen on host:port (0: a free port); returns the runner and the base URL that OpenAI clients
    take, ``http://HOST:PORT/v1``. ``await runner.cleanup()`` stops it: requests still running after
    ``shutdown_grace`` seconds are cancelled (their sessions close on every server).

    ``handler_cancellation``: a client that disconnects cancels its request's task at once, rather
    than at the next failed write, so its generation stops within the lap it is in.
    """
    runner = web.AppRunner(gateway.app(), handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_grace)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    return runner, f"http://{url_host}:{bound_port}/v1"
