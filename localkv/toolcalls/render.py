"""A conversation with tools as the chat template reads it: the tools as its `tools` variable,
assistant calls as `tool_calls` (arguments as objects, which templates write with tojson) and
results as `tool` turns. A template without tool support gets a generic system block that
lists the tools and the generic JSON form instead, its calls written in that form and its
results as user turns (a template that accepts no system turn or no such history cannot
take tools)."""

import hashlib
import json

from localkv.errors import ModelError
from localkv.model.tokenizer import Tokenizer
from localkv.toolcalls.formats import Call, Family
from localkv.toolcalls.spec import Tool, ToolError

GENERIC_BLOCK = (
    "You can call these tools (JSON Schema of each one's arguments):\n{tools}\n\n"
    "To call tools, reply with only a JSON object of this form and nothing else:\n"
    '{{"tool_calls": [{{"name": "<tool name>", "arguments": {{<the arguments>}}}}]}}\n'
    "A tool's result comes back in the next user turn: then answer the question with it, in plain text."
)


def prompt(
    tok: Tokenizer, messages: list[dict], tools: list[Tool], family: Family, native: bool, variables: dict | None = None
) -> str:
    """The conversation's prompt text, ready for the assistant's turn."""
    names = {c["id"]: c["name"] for m in messages for c in m.get("tool_calls", ())}
    shown = [_native(m, names, family) if native else _generic(m, names, family) for m in messages]
    if tools and not native:
        shown = _with_block(shown, GENERIC_BLOCK.format(tools="\n".join(json.dumps(t.openai()) for t in tools)))
    offered = [t.openai() for t in tools] if native and tools else None  # mistral's template tests `is not none`
    try:
        return tok.render_chat(shown, add_generation_prompt=True, tools=offered, variables=variables)
    except ModelError as e:
        if not tools:
            raise
        raise ToolError(f"this model's chat template cannot take tools: {e}") from None


def _native(m: dict, names: dict[str, str], family: Family) -> dict:
    if m["role"] == "tool":
        cid = m["tool_call_id"]
        return {"role": "tool", "content": m["content"], "tool_call_id": _id(cid, family), "name": names.get(cid, "")}
    if not m.get("tool_calls"):
        return m
    calls = [
        {"id": _id(c["id"], family), "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in m["tool_calls"]
    ]
    return {"role": "assistant", "content": m["content"], "tool_calls": calls}


def _generic(m: dict, names: dict[str, str], family: Family) -> dict:
    if m["role"] == "tool":
        name = names.get(m["tool_call_id"], "the tool")
        return {"role": "user", "content": f"Result of {name}:\n{m['content']}"}
    if not m.get("tool_calls"):
        return m
    text = family.text([Call(c["name"], c["arguments"]) for c in m["tool_calls"]])
    return {"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + text}


def _with_block(messages: list[dict], block: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + block}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def _id(cid: str, family: Family) -> str:
    """Mistral's templates take only 9-letter ids: others are mapped, the same one every turn."""
    if family.name != "mistral" or (len(cid) == 9 and cid.isalnum()):
        return cid
    return hashlib.sha256(cid.encode()).hexdigest()[:9]
