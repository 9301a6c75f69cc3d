"""Tool calls in the Hermes 2 Pro format that Qwen2.5's template teaches its models:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Checking OpenAI's `tools`, the grammar a call must follow (each function's name and its
parameters' JSON schema), and parsing calls out of the text. The grammar is lazy for
tool_choice "auto" (free text until the model opens a call, as llama.cpp does) and
strict for "required" or a named function; "none" forbids opening a call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from edgespec.errors import InvalidRequestError, shown

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its generation."""

    tools: list[dict[str, Any]]  # as the template takes them
    gbnf: str | None  # the grammar of the calls (None: no constraint)
    lazy: bool  # the grammar starts at OPEN (tool_choice auto); else the answer is calls only
    forbid_open: bool  # tool_choice none: OPEN may not be generated


def check_tools(tools: Any, check_schema: Callable[[dict, str], None]) -> list[dict[str, Any]]:
    """OpenAI's tools list, each {"type": "function", "function": {name, description?, parameters?}};
    `check_schema(schema, what)` raises for parameters that are not a usable JSON schema."""
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("'tools' must be a non-empty list of {\"type\": \"function\", \"function\": "
                                  "{\"name\", \"parameters\"}} objects")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequestError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}; "
                                      f"only function tools exist")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"{where}.function.name {shown(name)} must be 1-64 letters, digits, _ . or -")
        if name in names:
            raise InvalidRequestError(f"{where}.function.name {shown(name)} is given twice; name each tool once")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema of type object, got "
                                      f"{shown(params, json.dumps)}")
        check_schema(params, f"{where}.function.parameters")
    return tools


def choose(tools: list[dict[str, Any]], choice: Any, parallel: bool,
           schema_gbnf: Callable[[dict, str, str], str]) -> ToolPlan:
    """The plan for `tool_choice` (none, auto, required, or {"type": "function", "function": {"name"}}).
    `schema_gbnf(schema, what, rule)` is llama.cpp's converter naming the schema's top rule."""
    choice = "auto" if choice is None else choice
    names = [t["function"]["name"] for t in tools]
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise InvalidRequestError(f"'tool_choice' {json.dumps(choice)} must name one of the tools "
                                      f"({', '.join(names)}) as {{\"type\": \"function\", \"function\": {{\"name\"}}}}")
        tools_called = [t for t in tools if t["function"]["name"] == name]
    elif choice in ("auto", "required"):
        tools_called = tools
    elif choice == "none":
        return ToolPlan(tools, None, False, True)
    else:
        raise InvalidRequestError(f"'tool_choice' {shown(choice)} must be none, auto, required or a named function")
    call = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        "arguments": t["function"].get("parameters", {"type": "object", "properties": {}})},
        "required": ["name", "arguments"]} for t in tools_called]}
    gbnf = schema_gbnf(call, "the tools' parameters", "tool-call-json")
    one = f'"{OPEN}" "\\n" tool-call-json "\\n" "{CLOSE}"'
    gbnf += f"\nroot ::= {one}" + (f' ("\\n" {one})*' if parallel else "") + "\n"
    return ToolPlan(tools, gbnf, choice == "auto", False)


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content before the first call, or None when empty; the calls in OpenAI's tool_calls shape).
    A call whose JSON does not parse (cut off by the length limit) stays in the content."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for m in _CALL.finditer(text, start):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    content = text[:start].strip()
    return content or None, calls


def for_template(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool_calls with their arguments as objects, as Qwen's template writes them
    with tojson (OpenAI sends them as JSON strings)."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass
        calls.append({**call, "function": fn})
    return {**message, "tool_calls": calls}
