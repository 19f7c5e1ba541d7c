"""Tool calls (OpenAI's ``tools`` / ``tool_choice``) over the swarm, enforced by a constraint.

A request whose ``tool_choice`` is ``"required"`` or names a function gets its reply constrained
(docs/design.md, "Constraints at the tail") to one call in the gateway's documented JSON format,
``{"name": <a tool's name>, "arguments": <an object valid for its parameters>}``, so the call always
parses and its arguments always validate; the reply becomes ``message.tool_calls`` (and, streamed, one
``tool_calls`` delta in the choice's last chunk) with ``finish_reason: "tool_calls"``. The tools are
described to the model in a system message (the same format), and earlier calls and their results
(``role: "tool"`` messages) are rendered as that JSON and as the tool's text. ``"none"`` answers in
text; ``"auto"`` (OpenAI's default with tools) leaves the reply free: one that is exactly a call of a
listed tool becomes ``tool_calls``, any other is text (streamed as it comes, except while it may
still be a call: from a leading "{" to the end). Templates' own tool formats are not used yet
(SmolLM2's template has none).
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Optional

from swarm.api.errors import bad_request


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


def call_schema(tools: dict[str, dict], tool_choice: Any) -> Optional[dict]:
    """The JSON schema a reply must match for ``tool_choice``; None for "none" and "auto" (OpenAI's
    default with tools), which leave the reply free. 400s name the field."""
    if tool_choice in ("none", None, "auto"):
        return None
    if tool_choice == "required":
        names = list(tools)
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in tools:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        names = [name]
    else:
        raise bad_request('tool_choice must be "none", "required" or {"type": "function", ...}', "tool_choice")
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, "arguments": tools[n]["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for n in names
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


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


def tool_calls(text: str, names: tuple[str, ...]) -> Optional[list[dict]]:
    """The reply as OpenAI's ``tool_calls``; None when it is not one complete call of a tool in
    ``names`` (cut by max_tokens, or, with "auto", a text answer)."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments"), dict):
        return None
    arguments = json.dumps(call["arguments"])
    function = {"name": call["name"], "arguments": arguments}
    return [{"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": function}]
