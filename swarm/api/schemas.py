"""Request bodies of the OpenAI API as msgspec structs, and their validation into GenerationParams.

Unknown fields are ignored (tools send many), but every field we read is type-checked, and a
value we cannot honour is refused with a 400 naming the parameter, never silently dropped.
Extensions beyond OpenAI's parameters use vLLM's names (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``) plus ``speculation`` and ``num_draft_tokens``; the
``openai`` client sends them with ``extra_body``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, NamedTuple, Optional, TypeVar, Union

import msgspec

from client._calls import compiler_for
from protocol.constraints import constraint_from_options, constraint_from_response_format
from protocol.messages import MAX_TOP_LOGPROBS
from swarm.api.engine import CHAT_ROLES, GenerationParams, ServedModel, check_prompt_ids
from swarm.api.errors import APIError, bad_request
from swarm.api.llama_tools import eom_token_id, split_builtins
from swarm.api.sampling_fields import INT64, sampling_of, stops_of
from swarm.api.tools import (
    JSON_FORMAT,
    LLAMA3_FORMAT,
    builtin_call_grammar,
    call_grammar,
    call_schema,
    call_text,
    checked_tools,
    forced_names,
    template_messages,
    template_tool_format,
    tools_prompt,
)


class ContentPart(msgspec.Struct):
    type: str
    text: Optional[str] = None


class ChatMessage(msgspec.Struct):
    role: str
    content: Union[str, list[ContentPart], None] = None
    tool_calls: Optional[list[Any]] = None  # an assistant turn's calls (swarm/api/tools.py)
    tool_call_id: Optional[str] = None  # a tool turn: the call it answers


class StreamOptions(msgspec.Struct):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False  # vLLM's: usage so far in every chunk


class Prediction(msgspec.Struct):
    """OpenAI's predicted output: text the answer will likely repeat. Here it seeds the drafts only,
    so it speeds up the answer and never changes it."""

    type: str
    content: Union[str, list[ContentPart]]


class _Request(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[dict[str, Any]] = None
    prediction: Optional[Prediction] = None
    user: Optional[str] = None  # accepted, unused (OpenAI's end-user id for abuse monitoring)
    # extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = False
    guided_json: Any = None  # vLLM's guided decoding: a JSON schema (object or JSON text)
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    speculation: Optional[str] = None
    num_draft_tokens: Optional[int] = None
    # "required": unconfirmed tokens are an error, not a reply (docs/api.md; client/_confirmation.py)
    audit: Optional[str] = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatRequest(_Request, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Any = None
    parallel_tool_calls: Optional[bool] = None  # OpenAI's: default true; false allows at most one call
    functions: Optional[list[Any]] = None
    function_call: Any = None
    modalities: Optional[list[str]] = None
    audio: Optional[dict[str, Any]] = None


class CompletionRequest(_Request, kw_only=True):
    prompt: Any
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


R = TypeVar("R", bound=msgspec.Struct)


def parse(body: bytes, kind: type[R]) -> R:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise bad_request(f"invalid request: {e}", _param_of(str(e))) from None
    except msgspec.DecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None


def _param_of(message: str) -> Optional[str]:
    match = re.search(r"at `\$\.(\w+)", message) or re.search(r"field `(\w+)`", message)
    return match.group(1) if match else None


def chat_params(req: ChatRequest, served: ServedModel, max_choices: int) -> tuple[list[GenerationParams], int]:
    """One validated generation per choice, and how many top log-probs to show per token (-1: none)."""
    if req.functions or req.function_call not in (None, "none"):
        param = "functions" if req.functions else "function_call"
        raise bad_request("functions are not supported by this gateway", param)
    if req.tool_choice not in (None, "none") and not req.tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if req.modalities not in (None, ["text"]):
        raise bad_request("only text output is supported (modalities ['text'])", "modalities")
    if req.audio is not None:
        raise bad_request("audio output is not supported", "audio")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    fmt = template_tool_format(served.tokenizer) if req.tools else JSON_FORMAT
    messages, schema, template_tools = chat_messages(req.messages, structured_calls=fmt is not JSON_FORMAT), None, None
    template_kwargs: dict[str, Any] = {}
    builtins: list[str] = []  # Llama 3.1's built-in tools among the tools (llama_tools.py)
    parallel = req.parallel_tool_calls is not False
    if req.tools:
        tools = checked_tools(req.tools)
        schema = call_schema(tools, req.tool_choice, fmt.arguments_key)
        if schema is not None and (req.response_format or any(getattr(req, n) is not None for n in GUIDED)):
            raise bad_request("a tool call and another constraint do not go together", "tool_choice")
        if fmt is JSON_FORMAT:
            messages = [{"role": "system", "content": tools_prompt(tools)}] + messages
        else:  # the template presents the tools in its own way (Llama 3.1's built-ins apart: llama_tools.py)
            custom, builtins = split_builtins(tools, served.tokenizer) if fmt is LLAMA3_FORMAT else (tools, [])
            template_tools = [{"type": "function", "function": {"name": n, **t}} for n, t in custom.items()] or None
            template_kwargs = {"builtin_tools": builtins} if builtins else {}
            messages = template_messages(messages)
    eom = eom_token_id(served.tokenizer) if builtins else None  # <|eom_id|>: ends a built-in call's turn
    prompt_ids = served.chat_prompt(messages, tools=template_tools, **template_kwargs)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    shown = (req.top_logprobs or 0) if req.logprobs else -1
    choices = _choices(req, served, [Prompt(prompt_ids, None)], max_tokens, "messages", shown, max_choices)
    if schema is not None:  # compiled once here; a tool's parameters that do not compile are a 400 naming tools
        try:
            # a forced reply holds several calls only when parallel_tool_calls is given true: under a
            # grammar that allows more, a small model (SmolLM2) writes calls until max_tokens
            several = req.parallel_tool_calls is True and fmt.parallel
            forced = forced_names(tools, req.tool_choice)
            if any(n in builtins for n in forced):  # Llama 3.1's own shape, <|python_tag|>name.call(...)
                grammar = builtin_call_grammar(tools, forced, builtins, req.parallel_tool_calls is True, eom)
                constraint = {"guided_grammar": grammar}
            elif not fmt.open and not several:  # one bare call: the JSON schema itself
                constraint = {"guided_json": schema}
            else:  # the template's wrapping, or several calls: a grammar around the schema's
                constraint = {"guided_grammar": call_grammar(schema, fmt, several)}
            compiler_for(served.tokenizer, served.vocab_size).compile(constraint_from_options(**constraint))
        except ValueError as e:
            raise bad_request(f"tools: {e}", "tools") from None
        choices = [dataclasses.replace(c, sampling={**c.sampling, **constraint}) for c in choices]
    if req.tools and req.tool_choice != "none":
        mode = "forced" if schema is not None else "auto"
        named = dict(tool_call=mode, tool_names=tuple(tools), tool_format=fmt.name, parallel_tool_calls=parallel)
        if eom is not None:  # a stop token like EOS
            named["stop_token_ids"] = (eom,)
        choices = [dataclasses.replace(c, **named) for c in choices]
    return choices, shown


def completion_params(
    req: CompletionRequest, served: ServedModel, max_choices: int
) -> tuple[list[GenerationParams], int]:
    """One validated generation per choice (prompt-major, then ``n``), and the top log-probs shown."""
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of not in (None, 1, req.n or 1):
        raise bad_request("best_of must equal n (choosing the best of several is not supported)", "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "logprobs")
    prompts = _prompts(req.prompt, served)
    shown = req.logprobs if req.logprobs is not None else -1
    max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's default for completions
    return _choices(req, served, prompts, max_tokens, "prompt", shown, max_choices), shown


class Prompt(NamedTuple):
    ids: list[int]
    text: Optional[str]  # as the request gave it (None: given as ids); what echo returns


ROLE_ALIASES = {"developer": "system", "ipython": "tool"}  # OpenAI's newer name; Llama 3.1's for tool results


def chat_messages(messages: list[ChatMessage], structured_calls: bool = False) -> list[dict[str, Any]]:
    """The messages as the chat template takes them; assistant tool calls as text in the documented
    format, or (``structured_calls``, for a template that renders tools) kept as ``tool_calls``."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    out = []
    for m in messages:
        role = ROLE_ALIASES.get(m.role, m.role)
        if role not in CHAT_ROLES:
            raise bad_request(f"unknown message role {m.role!r}; use system, user or assistant", "messages")
        if isinstance(m.content, list):
            if any(part.type != "text" or part.text is None for part in m.content):
                raise bad_request("only text content parts are supported", "messages")
            content = "".join(part.text for part in m.content)
        else:
            content = m.content or ""
        if m.tool_calls and structured_calls:
            out.append({"role": role, "content": content, "tool_calls": m.tool_calls})
            continue
        if m.tool_calls:
            content = (content + "\n" if content else "") + call_text(m.tool_calls)
        out.append({"role": role, "content": content})
    return out


def _prompts(prompt: Any, served: ServedModel) -> list[Prompt]:
    """A string, a list of ids, or a batch: a list of strings or of id lists."""
    if isinstance(prompt, str):
        return [_text_prompt(prompt, served)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [_text_prompt(p, served) for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [Prompt(check_prompt_ids(p, served, "prompt"), None) for p in prompt]
    if isinstance(prompt, list) and not any(isinstance(p, (str, list)) for p in prompt):
        return [Prompt(check_prompt_ids(prompt, served, "prompt"), None)]
    raise bad_request(
        "prompt must be a string, a list of token ids, or a batch: a list of strings or a list of token-id lists",
        "prompt",
    )


def _text_prompt(text: str, served: ServedModel) -> Prompt:
    if not text:
        raise bad_request("the prompt is empty", "prompt")
    return Prompt(served.encode(text), text)


def _choices(
    req: _Request,
    served: ServedModel,
    prompts: list[Prompt],
    max_tokens: Optional[int],
    prompt_param: str,
    shown_logprobs: int,
    max_choices: int,
) -> list[GenerationParams]:
    """``n`` choices per prompt, each its own concurrent session. With a seed, choice j of a prompt
    samples with seed + j (as vLLM does), so the same request gives the same choices again."""
    n = 1 if req.n is None else req.n
    if n < 1:
        raise bad_request(f"n must be at least 1, got {n}", "n")
    if len(prompts) * n > max_choices:
        message = (
            f"{len(prompts)} prompt(s) x n={n} make {len(prompts) * n} choices; this gateway runs at most "
            f"{max_choices} per request: split the batch"
        )
        raise bad_request(message, "n" if n > 1 else prompt_param, code="too_many_choices")
    echo = bool(getattr(req, "echo", False))
    base = _common(req)
    base.sampling.update(_constraint(req, served))
    if any(not token < served.vocab_size for token in base.sampling["logit_bias"]):
        raise bad_request(f"logit_bias names a token id outside the vocabulary [0, {served.vocab_size})", "logit_bias")
    choices = []
    for index, prompt in enumerate(prompts):
        limit = _max_tokens(len(prompt.ids), max_tokens, served, prompt_param, echo)
        text = prompt.text if prompt.text is not None else served.tokenizer.decode(prompt.ids, skip_special_tokens=True)
        for j in range(n):
            sampling = dict(base.sampling)
            if sampling.get("seed") is not None:
                sampling["seed"] = (sampling["seed"] + j + INT64) % (2 * INT64) - INT64  # a signed 64-bit int still
            choices.append(
                dataclasses.replace(
                    base,
                    prompt_ids=prompt.ids,
                    max_tokens=limit,
                    sampling=sampling,
                    prompt_index=index,
                    num_logprobs=max(shown_logprobs, 1) if shown_logprobs >= 0 else 0,
                    echo=text if echo else None,
                    prompt_logprobs=shown_logprobs if echo else -1,
                )
            )
    return choices


def _common(req: _Request) -> GenerationParams:
    """What every choice of the request shares (prompt and length are set per choice)."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options needs stream: true", "stream_options")
    return GenerationParams(
        prompt_ids=[], max_tokens=0, stop=stops_of(req.stop), ignore_eos=bool(req.ignore_eos), sampling=sampling_of(req)
    )


GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _constraint(req: _Request, served: ServedModel) -> dict[str, Any]:
    """response_format or one of vLLM's guided_* extras -> generate()'s arguments, compiled here once
    so that a schema, regex or grammar the library refuses is a 400 naming the parameter."""
    given = [name for name in GUIDED if getattr(req, name) is not None]
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        given.insert(0, "response_format")
    if len(given) > 1:
        raise bad_request(f"give one constraint at a time, got {' and '.join(given)}", given[1])
    if not given:
        return {}
    param = given[0]
    try:
        if param == "response_format":
            constraint = constraint_from_response_format(req.response_format)
        else:
            constraint = constraint_from_options(**{param: getattr(req, param)})
        compiler_for(served.tokenizer, served.vocab_size).compile(constraint)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from None
    return {param: getattr(req, param)}


def _max_tokens(
    prompt_tokens: int, max_tokens: Optional[int], served: ServedModel, prompt_param: str, echo: bool = False
) -> int:
    """max_tokens checked against the context; 0 only with echo (scoring the prompt alone)."""
    param = "max_tokens"
    context = served.context_length
    if prompt_tokens > context or (prompt_tokens == context and not (echo and max_tokens == 0)):
        message = f"this model's maximum context length is {context} tokens, but the prompt has {prompt_tokens} tokens"
        raise APIError(400, message, "invalid_request_error", param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:  # capped: each hop reserves cache for prompt + max_tokens
        return min(context - prompt_tokens, served.default_max_tokens)
    if max_tokens < (0 if echo else 1):
        raise bad_request(
            f"{param} must be at least {0 if echo else 1} {'with' if echo else 'without'} echo, got {max_tokens}", param
        )
    if prompt_tokens + max_tokens > context:
        raise APIError(
            400,
            f"this model's maximum context length is {context} tokens; the prompt ({prompt_tokens}) "
            f"plus {param} ({max_tokens}) exceeds it",
            "invalid_request_error",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens
