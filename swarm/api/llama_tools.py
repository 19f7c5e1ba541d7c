"""Llama 3.1's own tool-call syntax: a reply that starts with ``<|python_tag|>``.

Meta's Llama 3.1 prompt format has two kinds of tools. Custom tools (the ``tools`` of a request) are
called with a bare ``{"name": ..., "parameters": {...}}`` (swarm/api/tools.py, ``LLAMA3_FORMAT``).
Built-in tools, which the model was trained to call on its own, are named in the system message
(``Environment: ipython`` / ``Tools: brave_search, wolfram_alpha``) and called after the
``<|python_tag|>`` token, the turn ending with ``<|eom_id|>`` (the executor runs the call and answers
in an ``ipython`` turn)::

    <|python_tag|>brave_search.call(query="weather in Oslo")
    <|python_tag|>wolfram_alpha.call(query="100th decimal of pi")
    <|python_tag|>print(sum(range(10)))          (code_interpreter: the text is the code)

and a custom call may follow the tag too (``<|python_tag|>{"name": ..., "parameters": ...}``, which is
what vLLM's ``llama3_json`` parser reads). A request's tool named like a built-in one is given to the
template as a built-in (its ``builtin_tools``, where the template takes them, as Meta's does), and
each of these replies becomes an OpenAI tool call: the built-ins' keyword arguments as the arguments
object, code_interpreter's code as ``{"code": ...}`` (llama-stack's mapping).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Optional

PYTHON_TAG = "<|python_tag|>"
BUILTIN_TOOLS = ("brave_search", "wolfram_alpha", "code_interpreter")
_CALL = re.compile(r"\s*([A-Za-z_]\w*)\.call\((.*)\)\s*", re.S)


def takes_builtin_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders built-in tools (Meta's reads ``builtin_tools``)."""
    return "builtin_tools" in str(getattr(tokenizer, "chat_template", None) or "")


def split_builtins(tools: dict[str, dict], tokenizer: Any) -> tuple[dict[str, dict], list[str]]:
    """The custom tools and the built-in names among ``tools``, for a template that takes built-ins;
    all custom for one that does not (it cannot present them, so they are described as custom)."""
    if not takes_builtin_tools(tokenizer):
        return tools, []
    builtins = [name for name in tools if name in BUILTIN_TOOLS]
    return {n: t for n, t in tools.items() if n not in builtins}, builtins


def tagged(text: str) -> Optional[str]:
    """What follows ``<|python_tag|>`` at the start of ``text`` (leading spaces allowed); None without it."""
    head = text.lstrip()
    return head[len(PYTHON_TAG) :] if head.startswith(PYTHON_TAG) else None


def tagged_call(body: str, names: tuple[str, ...], arguments_keys: tuple[str, ...]) -> Optional[tuple[str, dict]]:
    """(name, arguments) of the call after the tag, or None when it is no call of a tool in ``names``:
    a JSON call (``arguments_keys``: where its arguments may be), a built-in's ``name.call(k=v, ...)``
    with literal values, or any other text as code_interpreter's code when that tool is listed."""
    try:
        call = json.loads(body)
    except ValueError:
        call = None
    if isinstance(call, dict):
        arguments = next((call[k] for k in arguments_keys if k in call), None)
        if call.get("name") in names and isinstance(arguments, dict):
            return call["name"], arguments
        return None
    found = _CALL.fullmatch(body)
    if found is not None and found.group(1) in names:
        arguments = _keywords(found.group(2))
        if arguments is not None:
            return found.group(1), arguments
    if "code_interpreter" in names and body.strip():
        return "code_interpreter", {"code": body.strip()}
    return None


def _keywords(text: str) -> Optional[dict[str, Any]]:
    """``k="v", n=3`` as {"k": "v", "n": 3}; None unless every argument is a keyword with a literal value."""
    try:
        expression = ast.parse(f"f({text})", mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(expression, ast.Call) or expression.args:
        return None
    arguments: dict[str, Any] = {}
    for keyword in expression.keywords:
        if keyword.arg is None:  # **spread
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    return arguments
