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
object, code_interpreter's code as ``{"code": ...}`` (llama-stack's mapping); several built-in calls
separated by ``;`` become several tool calls. A forced built-in call is constrained to this shape
(:func:`builtin_grammar`), ending with the ``<|eom_id|>`` token itself, and ``<|eom_id|>`` ends the reply
as EOS does while built-ins are on (a stop id of the client and of the constraint's matchers alike).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Optional

PYTHON_TAG = "<|python_tag|>"
EOM_ID = "<|eom_id|>"  # ends a built-in call's turn: the executor answers in an ipython turn
BUILTIN_TOOLS = ("brave_search", "wolfram_alpha", "code_interpreter")


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
    """What follows ``<|python_tag|>`` at the start of ``text`` (leading spaces allowed), without a
    closing ``<|eom_id|>``; None without the tag."""
    head = text.lstrip()
    if not head.startswith(PYTHON_TAG):
        return None
    body = head[len(PYTHON_TAG) :].rstrip()
    # <|eom_id|> as text: the forced grammar ends with it, and a model may spell it in pieces
    return body[: -len(EOM_ID)] if body.endswith(EOM_ID) else body


Calls = list[tuple[str, dict]]  # (name, arguments) of each call


def tagged_calls(body: str, names: tuple[str, ...], arguments_keys: tuple[str, ...]) -> Optional[Calls]:
    """The (name, arguments) of each call after the tag, or None when the body is no call of tools in
    ``names``: a JSON call (``arguments_keys``: where its arguments may be); one or several built-in
    calls ``name.call(k=v, ...)`` with literal values, separated by ``;`` (Meta's format allows
    several); or any other text as code_interpreter's code when that tool is listed. A body with a
    malformed piece (a ``;``-separated part that is no such call) is not read as calls at all: the
    whole body is no list of calls (or is code_interpreter's code); the gateway reads the complete calls
    before such a piece first (:func:`leading_builtin_calls`), and the rest is the reply's text."""
    try:
        call = json.loads(body)
    except ValueError:
        call = None
    if isinstance(call, dict):
        arguments = next((call[k] for k in arguments_keys if k in call), None)
        if call.get("name") in names and isinstance(arguments, dict):
            return [(call["name"], arguments)]
        return None
    found = _builtin_calls(body, names)
    if found is not None:
        return found
    if "code_interpreter" in names and body.strip():
        return [("code_interpreter", {"code": body.strip()})]
    return None


def _builtin_calls(body: str, names: tuple[str, ...]) -> Optional[Calls]:
    """``a.call(k=v); b.call(k=v)`` as [(a, {k: v}), (b, {k: v})]; None unless every ``;``-separated
    statement is a call of a listed tool with literal keyword arguments (read by ``ast``, never run)."""
    try:
        module = ast.parse(body.strip(), mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    calls: list[tuple[str, dict]] = []
    for statement in module.body:
        expression = statement.value if isinstance(statement, ast.Expr) else None
        function = expression.func if isinstance(expression, ast.Call) else None
        if not (
            isinstance(function, ast.Attribute)
            and function.attr == "call"
            and isinstance(function.value, ast.Name)
            and function.value.id in names
        ):
            return None
        arguments = _literal_keywords(expression)  # type: ignore[arg-type]
        if arguments is None:
            return None
        calls.append((function.value.id, arguments))
    return calls or None


def leading_builtin_calls(text: str, names: tuple[str, ...], in_body: bool = False) -> tuple[Calls, int]:
    """The built-in calls at the start of ``text`` (after ``<|python_tag|>``; ``in_body``: text that
    continues a body whose tag came earlier) that are complete whatever follows: each ``name.call(...)``
    once the ``;`` or newline after it has come (Python ends a statement there; a separator inside a
    string literal is none: the piece up to it does not parse), and the characters they take with their
    separators. A streamed reply sends each as soon as it is complete (swarm/api/responses.py); the first
    piece that is no such call ends them (what follows is the reply's text)."""
    cut = 0
    if not in_body:
        head = text.lstrip()
        if not head.startswith(PYTHON_TAG):
            return [], 0
        cut = len(text) - len(head) + len(PYTHON_TAG)
    calls: Calls = []
    used = 0
    for separator in _SEPARATOR.finditer(text, cut):
        piece = text[cut : separator.start()]
        found = _builtin_calls(piece, names)
        if found:
            calls += found
            cut = used = separator.end()
        elif piece.strip() and _parses(piece):  # whole statements, not all calls: nothing later is one
            break
    return calls, used


def _parses(text: str) -> bool:
    try:
        ast.parse(text.strip(), mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


_SEPARATOR = re.compile(r"[;\n]")  # what ends a statement of Meta's built-in calls


def _literal_keywords(expression: ast.Call) -> Optional[dict[str, Any]]:
    """A call's ``k="v", n=3`` as {"k": "v", "n": 3}; None unless every argument is a keyword with a literal value."""
    if expression.args:
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


# a Python string literal in double quotes without a newline (a built-in's argument; ast.literal_eval reads it)
_RULES = (
    'builtin_str ::= "\\"" builtin_char* "\\""\n'
    'builtin_char ::= [^"\\\\\\n] | "\\\\" ["\\\\nt]\n'
    'builtin_int ::= "-"? [0-9]+\n'
    'builtin_num ::= "-"? [0-9]+ ("." [0-9]+)?\n'
    'builtin_bool ::= "True" | "False"\n'
    "builtin_code ::= [^]+\n"
)


def eom_token_id(tokenizer: Any) -> Optional[int]:
    """``<|eom_id|>``'s id in the tokenizer's vocabulary (Llama 3.1's generation_config lists it among
    its eos ids, besides ``<|eot_id|>``); None for a tokenizer without it. Looked up by name, not by a
    fixed id, so any Llama 3.1 derivative's vocabulary works."""
    token_id = tokenizer.convert_tokens_to_ids(EOM_ID)  # an unknown token: None, or the unknown token's id
    if not isinstance(token_id, int) or token_id == getattr(tokenizer, "unk_token_id", None):
        return None
    return token_id


def builtin_grammar(builtins: dict[str, dict], several: bool, end: Optional[int]) -> str:
    """EBNF rules (xgrammar's dialect; the start rule is ``builtin_tagged``) for Llama 3.1's own
    built-in call shape: ``<|python_tag|>`` then ``name.call(k=v, ...)`` for a tool in ``builtins``
    (name -> parameters), the keywords those the parameters require (all their properties when none
    is required; ``query`` when they name none, Meta's brave_search/wolfram_alpha signature) with
    literal values of each property's type (one of its ``enum`` values where it lists them); with
    ``several``, one or more calls joined by ``"; "``; code_interpreter's call is free code (alone:
    code cannot be split into calls). ``end``: the id of the token the call ends with (``<|eom_id|>``'s,
    as xgrammar's ``Token(id)``: that one token, never its text spelled in pieces, so the output ends
    exactly where the client stops; the call makes it a stop id of the constraint too), or None where
    the vocabulary has none: then the stop token ends it."""
    alternatives, rules = [], []
    for name, parameters in builtins.items():
        if name == "code_interpreter":
            continue
        pieces = []
        for i, (key, value_rule) in enumerate(_argument_rules(parameters)):
            pieces.append(json.dumps(f"{', ' if i else ''}{key}=") + " " + value_rule)
        rules.append(f"builtin_{name} ::= {json.dumps(name + '.call(')} {' '.join(pieces)} {json.dumps(')')}")
        alternatives.append(f"builtin_{name}")
    bodies = []
    if alternatives:
        rules.append("builtin_one ::= " + " | ".join(alternatives))
        bodies.append('builtin_one ("; " builtin_one)*' if several else "builtin_one")
    if "code_interpreter" in builtins:
        bodies.append("builtin_code")
    tail = f" Token({int(end)})" if end is not None else ""
    tagged_rule = f"builtin_tagged ::= {json.dumps(PYTHON_TAG)} ({' | '.join(bodies)}){tail}"
    return "\n".join([tagged_rule, *rules, _RULES])


def _argument_rules(parameters: dict) -> list[tuple[str, str]]:
    """(keyword, value rule) for each argument a forced built-in call writes, in the schema's order."""
    properties = parameters.get("properties") if isinstance(parameters.get("properties"), dict) else {}
    required = [k for k in parameters.get("required", []) if k in properties] if properties else []
    keys = required or list(properties) or ["query"]
    out = []
    for key in keys:
        if not key.isidentifier():
            raise ValueError(f"a built-in tool's argument {key!r} is no Python keyword")
        schema = properties.get(key, {"type": "string"})
        schema = schema if isinstance(schema, dict) else {}
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, (str, int, bool)) for v in enum):
            # one of the listed values, each as its Python literal (json.dumps of a string is one)
            literals = [repr(v) if isinstance(v, bool) else json.dumps(v) for v in enum]
            out.append((key, "(" + " | ".join(json.dumps(literal) for literal in literals) + ")"))
            continue
        kind = schema.get("type")
        rule = {"integer": "builtin_int", "number": "builtin_num", "boolean": "builtin_bool"}.get(kind, "builtin_str")
        out.append((key, rule))
    return out
