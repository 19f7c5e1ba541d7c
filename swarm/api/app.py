"""The aiohttp application: routes, API keys, the per-key concurrency limit, JSON and SSE replies.

A request, top to bottom (``Gateway._generate``):
  1) authenticate (``Authorization: Bearer KEY``, when keys are configured);
  2) parse and validate the body; find the model (400 / 404 before any swarm work);
  3) take one of the key's concurrency slots (429 when none is free);
  4) generate under the request's deadline, one concurrent session per choice (a batch of
     prompts, ``n``), merged as they come (``merged_deltas``); a streamed reply sends its headers
     with the first lap, so errors before any token (no route, timeout) still get their own status;
  5) a client that goes away cancels the request's task (aiohttp's handler cancellation, or
     the next failed write): the generation stops and its session closes on every server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Mapping, Optional, Union

import msgspec
from aiohttp import web

from client import AutoDistributedModelForCausalLM
from swarm.api.engine import DEFAULT_MAX_TOKENS, Delta, ServedModel, TextGeneration
from swarm.api.errors import APIError, bad_request, from_exception
from swarm.api.responses import ChatFormat, CompletionFormat, speculation_headers
from swarm.api.schemas import ChatRequest, CompletionRequest, chat_params, completion_params, parse
from swarm.api.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize, tokenizer_info

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20
MAX_CHOICES_PER_REQUEST = 32
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
    # choices one request may ask for (prompts in a batch x n): each is a session on every hop
    max_choices_per_request: int = MAX_CHOICES_PER_REQUEST


class ConcurrencyLimiter:
    """Requests in flight per key; all on the event loop's thread, so a plain counter."""

    def __init__(self, limit: int):
        self.limit = limit
        self.active: Counter[str] = Counter()

    @contextlib.contextmanager
    def slot(self, key: str) -> Iterator[None]:
        if self.limit and self.active[key] >= self.limit:
            message = (
                f"this API key already has {self.active[key]} requests in flight (limit "
                f"{self.limit}); retry when one finishes"
            )
            raise APIError(429, message, "rate_limit_error", code="concurrency_limit_exceeded")
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
        self.created = int(time.time())  # the models' "created": when this gateway started serving them

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
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.tokenizer_info)
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
        if self.config.api_keys and request.path != "/health":
            key = _bearer(request)
            if key is None or not any(hmac.compare_digest(key.encode(), k.encode()) for k in self.config.api_keys):
                raise APIError(
                    401,
                    "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                    "authentication_error",
                    code="invalid_api_key",
                )
        return await handler(request)

    # ---- routes ------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok", "models": sorted(self.models), "requests_in_flight": self.requests_in_flight})

    async def list_models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [self._model_card(served) for served in self.models.values()]})

    async def get_model(self, request: web.Request) -> web.Response:
        return _json(self._model_card(self._served(request.match_info["model"])))

    def _model_card(self, served: ServedModel) -> dict[str, Any]:
        """OpenAI's model object, plus vLLM's ``root`` and ``max_model_len`` (the context length)."""
        return {
            "id": served.name,
            "object": "model",
            "created": self.created,
            "owned_by": "specswarm",
            "root": served.name,
            "parent": None,
            "max_model_len": served.context_length,
        }

    async def tokenize(self, request: web.Request) -> web.Response:
        req = parse(await request.read(), TokenizeRequest)
        return _json(tokenize(req, self._served_or_only(req.model)))

    async def detokenize(self, request: web.Request) -> web.Response:
        req = parse(await request.read(), DetokenizeRequest)
        return _json(detokenize(req, self._served_or_only(req.model)))

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        return _json(tokenizer_info(self._served_or_only(request.query.get("model"))))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = parse(await request.read(), ChatRequest)
        served = self._served(req.model)
        params, shown = chat_params(req, served, self.config.max_choices_per_request)
        generations = [TextGeneration(served, p, buffered=not req.stream) for p in params]
        return await self._generate(request, req, generations, ChatFormat(served, generations, shown))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse(await request.read(), CompletionRequest)
        served = self._served(req.model)
        params, shown = completion_params(req, served, self.config.max_choices_per_request)
        generations = [TextGeneration(served, p, buffered=not req.stream) for p in params]
        return await self._generate(request, req, generations, CompletionFormat(served, generations, shown))

    def _served_or_only(self, name: Optional[str]) -> ServedModel:
        if name is None and len(self.models) > 1:
            names = ", ".join(sorted(self.models))
            raise bad_request(f"this gateway serves several models ({names}): name one", "model")
        return self._served(name) if name is not None else next(iter(self.models.values()))

    def _served(self, name: str) -> ServedModel:
        served = self.models.get(name)
        if served is None:
            message = f"the model {name!r} does not exist on this gateway; it serves {', '.join(sorted(self.models))}"
            raise APIError(404, message, "not_found_error", param="model", code="model_not_found")
        return served

    # ---- generation --------------------------------------------------------------------------

    async def _generate(
        self,
        request: web.Request,
        req: Any,
        generations: list[TextGeneration],
        fmt: Union[ChatFormat, CompletionFormat],
    ) -> web.StreamResponse:
        with self.limiter.slot(_bearer(request) or ""):
            deadline = asyncio.get_running_loop().time() + self.config.request_timeout
            if req.stream:
                return await self._stream(request, generations, fmt, deadline, req.include_usage, req.continuous_usage)
            deltas: list[list[Delta]] = [[] for _ in generations]
            try:
                async with asyncio.timeout_at(deadline):
                    async with contextlib.aclosing(merged_deltas(generations)) as stream:
                        async for index, delta in stream:
                            if delta is None:
                                continue
                            if delta.restart:  # a spot-check replaced tokens: this delta holds all of them
                                deltas[index] = [d for d in deltas[index] if d.echo]
                            deltas[index].append(delta)
            except Exception as e:
                raise from_exception(e, fmt.served.name) from None
            return _json(fmt.response(deltas), headers=speculation_headers(fmt.stats()))

    async def _stream(
        self,
        request: web.Request,
        generations: list[TextGeneration],
        fmt: Union[ChatFormat, CompletionFormat],
        deadline: float,
        include_usage: bool,
        continuous_usage: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        async with contextlib.aclosing(merged_deltas(generations)) as stream:
            try:
                async with asyncio.timeout_at(deadline):
                    first = await anext(stream, None)  # before the headers: early errors keep their status
            except Exception as e:
                raise from_exception(e, fmt.served.name) from None
            await response.prepare(request)
            try:
                await self._send_chunks(response, stream, first, fmt, deadline, include_usage, continuous_usage)
                await response.write(b"data: [DONE]\n\n")
            except ConnectionResetError:  # leaving the block closes the stream: the generation stops
                logger.info("The client went away mid-stream; its generation is cancelled")
        return response

    async def _send_chunks(
        self,
        response: web.StreamResponse,
        stream: AsyncIterator[tuple[int, Optional[Delta]]],
        item: Optional[tuple[int, Optional[Delta]]],
        fmt: Union[ChatFormat, CompletionFormat],
        deadline: float,
        include_usage: bool,
        continuous_usage: bool,
    ) -> None:
        usage = fmt.usage if continuous_usage else None  # vLLM's continuous_usage_stats: usage so far in each chunk
        try:
            for index in range(len(fmt.generations)):
                await _send(response, fmt.opening_chunk(index), usage)
            async with asyncio.timeout_at(deadline):
                while item is not None:
                    index, delta = item
                    if delta is None:  # this choice is done
                        await _send(response, fmt.closing_chunk(index), usage)
                    elif fmt.wants_chunk(index, delta):
                        await _send(response, fmt.chunk(index, delta), usage)
                    item = await anext(stream, None)
        except ConnectionResetError:
            raise
        except Exception as e:  # the headers are sent: report in the stream, as OpenAI does
            await _send(response, from_exception(e, fmt.served.name).body())
            return
        if include_usage:
            await _send(response, fmt.usage_chunk())


async def merged_deltas(generations: list[TextGeneration]) -> AsyncIterator[tuple[int, Optional[Delta]]]:
    """Every choice's deltas as they come, each with its choice's index, and ``(index, None)`` when
    that choice ends. The choices run as concurrent sessions; the first error ends them all (the
    others are cancelled, so their sessions close) and is raised here."""
    queue: asyncio.Queue[tuple[int, Optional[Delta], Optional[Exception]]] = asyncio.Queue()

    async def pump(index: int, generation: TextGeneration) -> None:
        try:
            async with contextlib.aclosing(generation.deltas()) as deltas:
                async for delta in deltas:
                    queue.put_nowait((index, delta, None))
            queue.put_nowait((index, None, None))
        except Exception as e:
            queue.put_nowait((index, None, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            index, delta, error = await queue.get()
            if error is not None:
                raise error
            remaining -= delta is None
            yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _send(
    response: web.StreamResponse,
    payload: Optional[dict[str, Any]],
    usage: Optional[Callable[[], dict[str, int]]] = None,
) -> None:
    if payload is not None:
        if usage is not None:
            payload["usage"] = usage()
        await response.write(b"data: " + msgspec.json.encode(payload) + b"\n\n")


def _json(body: Any, status: int = 200, headers: Optional[dict[str, str]] = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), status=status, headers=headers, content_type="application/json")


def _error_response(error: APIError) -> web.Response:
    return _json(error.body(), status=error.status)


def _bearer(request: web.Request) -> Optional[str]:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def start_server(
    gateway: Gateway, host: str = "127.0.0.1", port: int = 0, shutdown_grace: float = 5.0
) -> tuple[web.AppRunner, str]:
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
