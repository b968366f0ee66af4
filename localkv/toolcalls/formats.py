"""How each model family writes its tool calls: the trigger that opens them, the text of one
or more calls (what the grammar spells and a history re-renders), and the parser that reads
them back. As llama.cpp's common/chat.cpp and vLLM's tool parsers, one small class each:

- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call (Hermes, Qwen2.5, Qwen3)
- llama3: one `{"name": ..., "parameters": {...}}` object (Llama 3.x JSON tool calling)
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
- generic: `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` for templates without tools
"""

import json
from dataclasses import dataclass

from localkv.toolcalls.spec import Tool

# the JSON the grammar writes: no free whitespace, Python's json.dumps separators, so the text a
# model generated and the text a template re-renders from the parsed call are the same
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: dict

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


class Family:
    name = "generic"
    trigger = '{"tool_calls": ['
    args_key = "arguments"

    def call_schema(self, tools: list[Tool]) -> dict:
        """One call: the name of one of `tools` and that function's arguments."""
        each = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, self.args_key: t.parameters},
                "required": ["name", self.args_key],
                "additionalProperties": False,
            }
            for t in tools
        ]
        return each[0] if len(each) == 1 else {"anyOf": each}

    def calls_schema(self, tools: list[Tool], parallel: bool) -> dict:
        most = {} if parallel else {"maxItems": 1}
        return {"type": "array", "items": self.call_schema(tools), "minItems": 1} | most

    def lark(self, tools: list[Tool], parallel: bool, trigger_token: int | None = None) -> str:
        """The llguidance grammar of the calls, starting with the trigger's text."""
        schema = {"type": "object", "properties": {"tool_calls": self.calls_schema(tools, parallel)}}
        schema |= {"required": ["tool_calls"], "additionalProperties": False}
        return "%llguidance {}\nstart: body\nbody: %json " + _json(schema)

    def text(self, calls: list[Call]) -> str:
        """The calls as this family writes them (what the grammar lets a model spell)."""
        return json.dumps({"tool_calls": [self._obj(c) for c in calls]}, ensure_ascii=False)

    def parse(self, text: str) -> tuple[str, list[Call]] | None:
        """(the text before the calls, the calls), or None when the text holds no whole call."""
        at = text.find(self.trigger)
        if at < 0:
            return None
        got = _decode(text, at)
        if not isinstance(got, dict) or not isinstance(got.get("tool_calls"), list):
            return None
        calls = [self._call(c) for c in got["tool_calls"]]
        return (text[:at], calls) if calls and None not in calls else None

    def _obj(self, c: Call) -> dict:
        return {"name": c.name, self.args_key: c.arguments}

    def _call(self, obj) -> Call | None:
        ok = isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get(self.args_key), dict)
        return Call(obj["name"], obj[self.args_key]) if ok else None


class Hermes(Family):
    name = "hermes"
    trigger = "<tool_call>"

    def lark(self, tools: list[Tool], parallel: bool, trigger_token: int | None = None) -> str:
        more = ' ("\\n" call)*' if parallel else ""
        return (
            "%llguidance {}\n"
            f"start: call{more}\n"
            'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            "body: %json " + _json(self.call_schema(tools))
        )

    def text(self, calls: list[Call]) -> str:
        return "\n".join(f"<tool_call>\n{json.dumps(self._obj(c), ensure_ascii=False)}\n</tool_call>" for c in calls)

    def parse(self, text: str) -> tuple[str, list[Call]] | None:
        first = text.find(self.trigger)
        if first < 0:
            return None
        calls, at = [], first
        while at >= 0:
            start = at + len(self.trigger)
            call = self._call(_decode(text, start))
            if call is None:
                break
            calls.append(call)
            at = text.find(self.trigger, start)
        return (text[:first], calls) if calls else None


class Llama3(Family):
    name = "llama3"
    trigger = '{"name": '
    args_key = "parameters"

    def lark(self, tools: list[Tool], parallel: bool, trigger_token: int | None = None) -> str:
        return "%llguidance {}\nstart: body\nbody: %json " + _json(self.call_schema(tools))  # one call per reply

    def text(self, calls: list[Call]) -> str:
        return "; ".join(json.dumps(self._obj(c), ensure_ascii=False) for c in calls)

    def parse(self, text: str) -> tuple[str, list[Call]] | None:
        at = text.find(self.trigger)
        call = self._call(_decode(text, at)) if at >= 0 else None
        return (text[:at], [call]) if call else None


class Mistral(Family):
    name = "mistral"
    trigger = "[TOOL_CALLS]"

    def lark(self, tools: list[Tool], parallel: bool, trigger_token: int | None = None) -> str:
        opening = f"<[{trigger_token}]>" if trigger_token is not None else json.dumps(self.trigger)
        return f"%llguidance {{}}\nstart: {opening} body\nbody: %json " + _json(self.calls_schema(tools, parallel))

    def text(self, calls: list[Call]) -> str:
        return self.trigger + json.dumps([self._obj(c) for c in calls], ensure_ascii=False)

    def parse(self, text: str) -> tuple[str, list[Call]] | None:
        at = text.find(self.trigger)
        got = _decode(text, at + len(self.trigger)) if at >= 0 else None
        calls = [self._call(c) for c in got] if isinstance(got, list) else []
        return (text[:at], calls) if calls and None not in calls else None


FAMILIES = {f.name: f for f in (Hermes(), Llama3(), Mistral(), Family())}


def detect(template: str) -> Family:
    """The family a chat template's own tool format belongs to; generic when it has none."""
    if "tools" not in template:
        return FAMILIES["generic"]
    if "<tool_call>" in template:
        return FAMILIES["hermes"]
    if "[TOOL_CALLS]" in template:
        return FAMILIES["mistral"]
    if "<|python_tag|>" in template or "<|eom_id|>" in template or '"parameters"' in template:
        return FAMILIES["llama3"]
    return FAMILIES["generic"]


def _json(schema: dict) -> str:
    return json.dumps({"x-guidance": JSON_STYLE} | schema)


def _decode(text: str, at: int):
    """The JSON value at text[at:] (leading whitespace skipped), or None."""
    rest = text[at:].lstrip()
    try:
        return json.JSONDecoder().raw_decode(rest)[0]
    except ValueError:
        return None
