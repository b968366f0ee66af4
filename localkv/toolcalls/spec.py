"""What a request asks of tool calls: its tools (OpenAI's function tools, each with a JSON
Schema for its arguments) and its tool_choice, checked before any model work. A schema the
grammar engine cannot compile is refused here, in a fraction of a second."""

import json
import re
from dataclasses import dataclass

from localkv.errors import LocalkvError
from localkv.sampling import Constraint

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names (and the dots of some agents)
MODES = ("auto", "none", "required")


class ToolError(LocalkvError):
    """A tools field that cannot be honoured; `param` names it, `status` is the HTTP answer."""

    def __init__(self, message: str, param: str = "tools", status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict  # the arguments' JSON Schema

    def openai(self) -> dict:
        """The tool as OpenAI's API writes it (what chat templates read as `tools`)."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class Choice:
    mode: str  # auto | none | required | named
    name: str | None = None  # the function a named choice forces
    parallel: bool = False  # more than one call per reply


def read_tools(v) -> list[Tool]:
    """OpenAI's `tools`: a non-empty array of function tools with distinct names."""
    if not isinstance(v, list) or not v:
        raise ToolError("invalid 'tools': expected a non-empty array of tools")
    tools: list[Tool] = []
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ToolError(f"invalid '{where}': expected an object with 'type': 'function'", where)
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"invalid '{where}.function': expected an object", f"{where}.function")
        tools.append(_tool(fn, f"{where}.function"))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ToolError(f"invalid 'tools': the function name {dup!r} is given twice")
    return tools


def _tool(fn: dict, where: str) -> Tool:
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ToolError(f"invalid '{where}.name': expected 1-64 letters, digits, '_', '-' or '.'", f"{where}.name")
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise ToolError(f"invalid '{where}.description': expected a string", f"{where}.description")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ToolError(f"invalid '{where}.parameters': expected a JSON Schema object", f"{where}.parameters")
    if params.get("type", "object") != "object":
        raise ToolError(f"invalid '{where}.parameters': the arguments must be an object", f"{where}.parameters")
    _check_schema(params, f"{where}.parameters")
    return Tool(name, desc, params)


def _check_schema(schema: dict, where: str) -> None:
    from localkv.grammar import check  # llguidance loads only for requests with tools

    try:
        check(Constraint("json_schema", json.dumps(schema), where))
    except LocalkvError as e:
        raise ToolError(str(e), where) from None


def read_choice(v, tools: list[Tool] | None, parallel=None) -> Choice:
    """OpenAI's `tool_choice` ("auto" by default with tools, "none" without) and
    `parallel_tool_calls`; a named function must be one of the tools. One call per reply unless
    parallel calls are asked for, as llama-server: small models given the choice repeat a call
    until max_tokens cuts it."""
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("invalid 'parallel_tool_calls': expected a boolean", "parallel_tool_calls")
    par = bool(parallel)
    if v is None:
        return Choice("auto" if tools else "none", parallel=par)
    if isinstance(v, str):
        if v not in MODES:
            raise ToolError(f"invalid 'tool_choice': {v!r}, expected one of {', '.join(MODES)}", "tool_choice")
        if v != "none" and not tools:
            raise ToolError(f"'tool_choice': {v!r} needs 'tools'", "tool_choice")
        return Choice(v, parallel=par)
    fn = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolError(
            "invalid 'tool_choice': expected a mode or {'type': 'function', 'function': {'name': ...}}", "tool_choice"
        )
    if name not in {t.name for t in tools or ()}:
        raise ToolError(f"invalid 'tool_choice': no tool is named {name!r}", "tool_choice")
    return Choice("named", name, parallel=False)
