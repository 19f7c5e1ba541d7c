"""Tool calls (OpenAI's ``tools`` / ``tool_choice``) over the swarm, enforced by a constraint.

A request whose ``tool_choice`` is ``"required"`` or names a function gets its reply constrained
(docs/design.md, "Constraints at the tail") to one call in the gateway's documented JSON format,
``{"name": <a tool's name>, "arguments": <an object valid for its parameters>}``, so the call always
parses and its arguments always validate; the reply becomes ``message.tool_calls`` (streamed, each call
in one ``tool_calls`` delta as soon as it is complete: :func:`leading_calls`) with ``finish_reason:
"tool_calls"``. The tools are
described to the model in a system message (the same format), and earlier calls and their results
(``role: "tool"`` messages) are rendered as that JSON and as the tool's text. ``"none"`` answers in
text; ``"auto"`` (OpenAI's default with tools) leaves the reply free: one that is exactly a call of a
listed tool becomes ``tool_calls``, any other is text (streamed as it comes, except while it may
still be a call: from a leading "{" to the end; a Llama 3.1 reply's text before ``<|python_tag|>``
streams as content, and the built-in calls after it go out each once complete, as forced ones do).

A chat template that renders ``tools`` itself in the Hermes/Qwen way (its text mentions ``<tool_call>``)
gets them through the template, and its calls are ``<tool_call>\n{...}\n</tool_call>`` (the format its
models were trained on): the grammar and the parser follow it (:class:`ToolFormat`). One that renders
them the Llama 3.1 way (the tools as JSON in the prompt, a call a bare ``{"name": ..., "parameters":
{...}}``: its text mentions ``"parameters"`` and no ``<tool_call>``) gets its calls in that shape, one
per reply (the Llama 3.1 template renders one call per assistant turn). Templates without tool support
(SmolLM2's) keep the documented format. A Llama 3.1 reply may also start with ``<|python_tag|>``:
built-in tools' calls (``brave_search.call(query="...")``, several joined by ``;``), code for
code_interpreter, or a JSON call (swarm/api/llama_tools.py); a forced built-in call is constrained to
that shape (:func:`builtin_call_grammar`). ``parallel_tool_calls`` (OpenAI's, default true) lets a reply
hold several calls, one per line; false allows at most one.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Optional

from swarm.api.errors import bad_request
from swarm.api.llama_tools import PYTHON_TAG, builtin_grammar, leading_builtin_calls, tagged, tagged_calls


def checked_tools(tools: list[Any]) -> dict[str, dict]:
    """name -> {"description", "parameters"}; a 400 naming ``tools`` for a malformed one."""
    found: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        name, parameters = function.get("name"), function.get("parameters", {"type": "object"})
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function has no name", "tools")
        if not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        found[name] = {"description": function.get("description", ""), "parameters": parameters}
    return found


def call_schema(tools: dict[str, dict], tool_choice: Any, arguments_key: str = "arguments") -> Optional[dict]:
    """The JSON schema a reply must match for ``tool_choice`` (the arguments under ``arguments_key``:
    the format's, :class:`ToolFormat`); None for "none" and "auto" (OpenAI's default with tools), which
    leave the reply free. 400s name the field."""
    names = forced_names(tools, tool_choice)
    if not names:
        return None
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, arguments_key: tools[n]["parameters"]},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for n in names
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def forced_names(tools: dict[str, dict], tool_choice: Any) -> list[str]:
    """The tools a forced reply may call: all for "required", the one named; none for "none" and
    "auto". A 400 naming ``tool_choice`` for an unknown name or value."""
    if tool_choice in ("none", None, "auto"):
        return []
    if tool_choice == "required":
        return list(tools)
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in tools:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return [name]
    raise bad_request('tool_choice must be "none", "required" or {"type": "function", ...}', "tool_choice")


def builtin_call_grammar(
    tools: dict[str, dict], names: list[str], builtins: list[str], several: bool, end: Optional[int]
) -> str:
    """The forced grammar when Llama 3.1 built-ins are among ``names``: a built-in's own shape after
    ``<|python_tag|>`` (swarm/api/llama_tools.py, ``builtin_grammar``), or, for the custom tools among
    ``names``, the bare ``{"name", "parameters"}`` object of :data:`LLAMA3_FORMAT`."""
    rules = builtin_grammar({n: tools[n]["parameters"] for n in names if n in builtins}, several, end)
    custom = {n: tools[n] for n in names if n not in builtins}
    if not custom:
        return "root ::= builtin_tagged\n" + rules
    schema = call_schema(custom, "required", LLAMA3_FORMAT.arguments_key)
    custom_rules = call_grammar(schema, LLAMA3_FORMAT, False).replace("root ::=", "custom_root ::=", 1)  # type: ignore[arg-type]
    return "root ::= builtin_tagged | custom_root\n" + custom_rules + "\n" + rules


def tools_prompt(tools: dict[str, dict]) -> str:
    """The system message that describes the tools (the gateway's documented format)."""
    listed = [{"name": n, "description": t["description"], "parameters": t["parameters"]} for n, t in tools.items()]
    return (
        "You can call these functions:\n"
        + json.dumps(listed)
        + '\nTo call one, reply with only {"name": <function name>, "arguments": <arguments object>}.'
    )


def call_text(tool_calls: list[Any]) -> str:
    """An assistant turn's earlier tool calls, as the JSON the model writes them in."""
    calls = []
    for call in tool_calls:
        function = (call or {}).get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:
            raise bad_request("an assistant message's tool_calls arguments are not JSON", "messages") from None
        calls.append({"name": function.get("name"), "arguments": arguments})
    return "\n".join(json.dumps(c) for c in calls)


@dataclass(frozen=True)
class ToolFormat:
    """How one call is written: ``open + JSON + close``, its arguments under ``arguments_key``; several
    calls are joined by a newline, where ``parallel`` (the format can hold several in one reply)."""

    name: str
    open: str
    close: str
    arguments_key: str = "arguments"
    parallel: bool = True


JSON_FORMAT = ToolFormat("json", "", "")  # the gateway's documented format
HERMES_FORMAT = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>")  # Hermes, Qwen 2/2.5/3
LLAMA3_FORMAT = ToolFormat("llama3", "", "", arguments_key="parameters", parallel=False)  # Llama 3.1/3.2/3.3
FORMATS = {f.name: f for f in (JSON_FORMAT, HERMES_FORMAT, LLAMA3_FORMAT)}
PROBE_TOOL = "specswarm_probe_tool"


def template_tool_format(tokenizer: Any) -> ToolFormat:
    """The format of the tokenizer's chat template, when it renders ``tools`` (a probe tool's name shows
    in its text): Hermes when it mentions ``<tool_call>``, Llama 3.1's when it mentions
    ``"parameters"`` (its instruction: respond in the format {"name": ..., "parameters": ...}); else
    the documented JSON format (a template that ignores tools, or another style)."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    if "<tool_call>" in template:
        candidate = HERMES_FORMAT
    elif '"parameters"' in template:
        candidate = LLAMA3_FORMAT
    else:
        return JSON_FORMAT
    probe = [{"type": "function", "function": {"name": PROBE_TOOL, "parameters": {"type": "object"}}}]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=probe, tokenize=False)
    except Exception:  # a template that fails on tools cannot present them
        return JSON_FORMAT
    return candidate if PROBE_TOOL in text else JSON_FORMAT


def call_grammar(schema: dict, fmt: ToolFormat, parallel: bool) -> str:
    """An EBNF grammar (xgrammar's dialect) for one call matching ``schema`` in ``fmt``, or, with
    ``parallel``, one or more calls joined by newlines. The call's JSON has no free whitespace (no
    newline inside), so a line holds exactly one call."""
    xgrammar = __import__("xgrammar")
    try:
        body = str(xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True))
    except Exception as e:  # xgrammar's own errors on a schema it refuses
        raise ValueError(f"the tool parameters do not compile: {str(e).strip()[:500]}") from None
    body = re.sub(r"\broot\b", "tool_call_json", body)
    call = " ".join(part for part in (json.dumps(fmt.open) if fmt.open else "", "tool_call_json") if part)
    call += f" {json.dumps(fmt.close)}" if fmt.close else ""
    more = ' ("\\n" tool_call_one)*' if parallel else ""
    return f"root ::= tool_call_one{more}\ntool_call_one ::= {call}\n{body}"


def call_texts(text: str, fmt: ToolFormat) -> Optional[list[str]]:
    """The JSON text of each call in ``text`` (calls joined by newlines); None when the text is not
    made only of calls in ``fmt``."""
    if fmt is LLAMA3_FORMAT and tagged(text) is not None:  # the rest of the reply is one call (code spans lines)
        return [text.strip()]
    if not fmt.open:
        lines = [line for line in text.strip().split("\n") if line.strip()]
        return lines or None
    pattern = re.escape(fmt.open.strip()) + r"\s*(.*?)\s*" + re.escape(fmt.close.strip())
    found = list(re.finditer(pattern, text, re.S))
    if not found or re.sub(pattern, "", text, flags=re.S).strip():
        return None
    return [m.group(1) for m in found]


def may_be_call(text: str, fmt: ToolFormat) -> bool:
    """Whether "auto" text so far may still turn out to be a call (streamed text is held while so)."""
    head = text.lstrip()
    if fmt is LLAMA3_FORMAT and (PYTHON_TAG.startswith(head) or head.startswith(PYTHON_TAG)):
        return True
    if not fmt.open:
        return not head or head.startswith("{")
    opening = fmt.open.strip()
    return opening.startswith(head) or head.startswith(opening)


def tool_calls(
    text: str, names: tuple[str, ...], fmt: ToolFormat = JSON_FORMAT, parallel: bool = True
) -> Optional[list[dict]]:
    """The reply as OpenAI's ``tool_calls`` (distinct ids); None when it is not made only of complete
    calls of tools in ``names`` (cut by max_tokens, or, with "auto", a text answer), or holds
    several calls while ``parallel`` is false (several: one per line, Hermes blocks, or Llama 3.1's
    built-in calls after ``<|python_tag|>`` separated by ``;``)."""
    body = tagged(text) if fmt is LLAMA3_FORMAT else None
    if body is not None:  # after <|python_tag|>: one call, or several built-in calls separated by ";"
        found = tagged_calls(body, names, (fmt.arguments_key, "arguments"))
        if found is None or (len(found) > 1 and not parallel):
            return None
        return [_openai_call(*call) for call in found]
    texts = call_texts(text, fmt)
    if texts is None or (len(texts) > 1 and not (parallel and fmt.parallel)):
        return None
    calls = [parse_call(one, names, fmt) for one in texts]
    return None if None in calls else calls  # type: ignore[return-value]


def parse_call(text: str, names: tuple[str, ...], fmt: ToolFormat) -> Optional[dict]:
    """One call's JSON text as an OpenAI tool call (a fresh id); None unless it names a listed tool
    and its arguments (under the format's key) are an object; in Llama 3.1's format, also a call after
    ``<|python_tag|>`` (swarm/api/llama_tools.py)."""
    body = tagged(text) if fmt is LLAMA3_FORMAT else None
    if body is not None:
        # after the tag vLLM's llama3_json reads "arguments" as well as the format's "parameters"
        found = tagged_calls(body, names, (fmt.arguments_key, "arguments"))
        return None if found is None or len(found) != 1 else _openai_call(*found[0])
    try:
        call = json.loads(text)
    except ValueError:
        return None
    arguments = call.get(fmt.arguments_key) if isinstance(call, dict) else None
    if not isinstance(call, dict) or call.get("name") not in names or not isinstance(arguments, dict):
        return None
    return _openai_call(call["name"], arguments)


def _openai_call(name: str, arguments: dict) -> dict:
    """An OpenAI tool call with a fresh id."""
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": function}


def leading_calls(text: str, names: tuple[str, ...], fmt: ToolFormat) -> tuple[list[dict], int]:
    """The calls at the start of ``text`` that are complete whatever follows, and the characters they
    take with their separators: a line of the JSON formats once its newline has come (a call's JSON
    has no newline inside), a Hermes call once its closing tag has. A streamed reply sends each as
    soon as it is complete (swarm/api/responses.py); the first text that is no such call ends them."""
    calls: list[dict] = []
    used = 0
    if not fmt.open:
        while (end := text.find("\n", used)) >= 0 and (call := parse_call(text[used:end], names, fmt)) is not None:
            calls.append(call)
            used = end + 1
        return calls, used
    pattern = re.compile(r"\s*" + re.escape(fmt.open.strip()) + r"\s*(.*?)\s*" + re.escape(fmt.close.strip()), re.S)
    while (found := pattern.match(text, used)) is not None and (call := parse_call(found.group(1), names, fmt)):
        calls.append(call)
        used = found.end()
    return calls, used


def streams_builtin_calls(tool_call: str, tool_format: str, names: tuple[str, ...]) -> bool:
    """Whether a reply's Llama 3.1 built-in calls go out one by one as each completes (its ``;`` or
    newline has come: a whole statement, which nothing after it changes), forced or "auto": a complete
    call stays one whatever follows, and a later piece that is no call ends the calls and is the reply's
    text, as text after complete calls is in the other formats. Not with code_interpreter among the
    tools: its free code may hold ``;`` and newlines, and a body that is not all calls is its code."""
    return bool(tool_call) and tool_format == LLAMA3_FORMAT.name and "code_interpreter" not in names


def leading_tagged_calls(text: str, names: tuple[str, ...], in_body: bool = False) -> tuple[list[dict], int]:
    """:func:`~swarm.api.llama_tools.leading_builtin_calls` as OpenAI tool calls (fresh ids)."""
    calls, used = leading_builtin_calls(text, names, in_body)
    return [_openai_call(*call) for call in calls], used


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that renders tools: assistant ``tool_calls`` with their arguments as
    objects (what Hermes-style templates serialise), tool results as ``role: "tool"``."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            structured = []
            for call in calls:
                function = (call or {}).get("function") or {}
                try:
                    arguments = json.loads(function.get("arguments") or "{}")
                except ValueError:
                    raise bad_request("an assistant message's tool_calls arguments are not JSON", "messages") from None
                structured.append(
                    {"type": "function", "function": {"name": function.get("name"), "arguments": arguments}}
                )
            m = {**m, "tool_calls": structured}
        out.append(m)
    return out
