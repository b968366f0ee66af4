"""OpenAI's HTTP API as localkv reads it: request bodies checked field by field and turned into
an Ask (sampling values for SamplingParams, the prompt or the chat), and the error shape.

A field localkv cannot honour yet (logit_bias, echo, the old `functions`, ...) is refused with
a 400 that names it, never ignored; tools are read by localkv/toolcalls/spec.py. Extensions of
llama-server's and vLLM's: top_k, min_p, repeat_penalty, ignore_eos, llama-server's DRY
fields (dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n), and
chat_template_kwargs (variables for the chat template; `enable_thinking` turns a thinking
model's thinking on or off). reasoning_effort sets a thinking model's budget (reasoning.EFFORT).
"""

import json
import math
from dataclasses import dataclass, field

from localkv.reasoning import EFFORT, RESERVED, effort
from localkv.sampling import MAX_LOGPROBS, Constraint
from localkv.toolcalls.spec import Choice, Tool, ToolError, read_choice, read_tools

MAX_N = 128  # choices per request (OpenAI's limit)
MAX_STOP = 16  # stop strings per request
DRY = {
    "dry_multiplier": (0, False),
    "dry_base": (1, False),
    "dry_allowed_length": (0, True),
    "dry_penalty_last_n": (-1, True),
}


class ApiError(Exception):
    """An answer other than 200, in OpenAI's error shape."""

    TYPES = {
        401: "invalid_request_error",
        404: "invalid_request_error",
        429: "rate_limit_error",
        500: "server_error",
        503: "server_error",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def unsupported(param: str, what: str = "") -> ApiError:
    return bad(f"'{param}' is not supported yet by localkv{what}", param, "unsupported_parameter")


@dataclass(slots=True)
class Ask:
    """A checked request: what to run and how to answer it."""

    kind: str  # chat | completion
    model: str | None
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token (0: the token's own only); None: none
    values: dict  # SamplingParams fields given by the request
    messages: list[dict] = field(default_factory=list)  # chat
    prompts: list = field(default_factory=list)  # completion: each a str or a list of token ids
    # the request's own context window, prompt and reply (Ollama's num_ctx; 0: the engine's
    # whole context), a reply without max_tokens running to its end; None: no window (OpenAI's)
    window: int | None = None
    tools: list[Tool] | None = None  # chat: the functions the reply may call
    tool_choice: Choice | None = None
    template_vars: dict = field(default_factory=dict)  # chat: more variables for the chat template
    thinking_asked: bool = False  # a model that does not think is refused (Ollama's think: true)


# ------------------------------------------------------------------ field readers


def _type_name(v) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
        type(None): "null",
    }.get(type(v), type(v).__name__)


def number(body: dict, name: str, lo: float | None = None, hi: float | None = None, integer: bool = False):
    """body[name] as a number within [lo, hi], or None when absent or null."""
    v = body.get(name)
    if v is None:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not math.isfinite(v):
        raise bad(f"invalid '{name}': expected {'an integer' if integer else 'a number'}, got {_type_name(v)}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        span = (
            f"between {lo} and {hi}"
            if lo is not None and hi is not None
            else f">= {lo}"
            if lo is not None
            else f"<= {hi}"
        )
        raise bad(f"invalid '{name}': {v} is out of range, must be {span}", name)
    return v


def flag(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"invalid '{name}': expected a boolean, got {_type_name(v)}", name)
    return v


def _stop(body: dict) -> tuple[str, ...] | None:
    v = body.get("stop")
    if v is None:
        return None
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("invalid 'stop': expected a string or an array of strings", "stop")
    if len(stops) > MAX_STOP:
        raise bad(f"invalid 'stop': {len(stops)} strings, at most {MAX_STOP}", "stop")
    if any(not s for s in stops):
        raise bad("invalid 'stop': an empty string would stop before the first token", "stop")
    return tuple(stops) or None


def _model(body: dict) -> str | None:
    v = body.get("model")
    if v is not None and not isinstance(v, str):
        raise bad(f"invalid 'model': expected a string, got {_type_name(v)}", "model")
    return v


def _stream(body: dict) -> tuple[bool, bool]:
    stream = flag(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise bad("invalid 'stream_options': expected an object", "stream_options")
    if not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    return stream, flag(opts, "include_usage")


def _refuse(body: dict, names: tuple[str, ...]):
    """Fields localkv does not implement: refused when they ask for anything."""
    for name in names:
        if body.get(name) not in (None, [], {}, "", "none", "auto"):  # "none"/"auto": tool_choice asking nothing
            raise unsupported(name)


def _sampling(body: dict) -> dict:
    """The SamplingParams fields a request sets (both APIs)."""
    values = {
        "temperature": number(body, "temperature", 0, 2),
        "top_p": number(body, "top_p", 0, 1),
        "top_k": number(body, "top_k", 0, None, integer=True),
        "min_p": number(body, "min_p", 0, 1),
        "repeat_penalty": number(body, "repeat_penalty", 0, None),
        "presence_penalty": number(body, "presence_penalty", -2, 2),
        "frequency_penalty": number(body, "frequency_penalty", -2, 2),
        **{name: number(body, name, lo, None, integer) for name, (lo, integer) in DRY.items()},
        "seed": number(body, "seed", 0, None, integer=True),
        "stop": _stop(body),
        "ignore_eos": flag(body, "ignore_eos") or None,
    }
    if values["top_p"] == 0:
        raise bad("invalid 'top_p': must be > 0 (use 'temperature': 0 for greedy decoding)", "top_p")
    if values["repeat_penalty"] == 0:
        raise bad("invalid 'repeat_penalty': must be > 0 (1 = off)", "repeat_penalty")
    return {k: v for k, v in values.items() if v is not None}


def _max_tokens(body: dict, *names: str) -> int | None:
    given = [v for v in (number(body, n, 1, None, integer=True) for n in names) if v is not None]
    if len(set(given)) > 1:
        raise bad(f"'{names[0]}' and '{names[1]}' disagree: give one", names[1])
    return given[0] if given else None


def _n(body: dict) -> int:
    return number(body, "n", 1, MAX_N, integer=True) or 1


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_type_name(body)}")
    return body


# ------------------------------------------------------------------ chat


def parse_chat(body) -> Ask:
    body = _object(body)
    _refuse(
        body,
        (
            "functions",
            "function_call",
            "logit_bias",
            "audio",
            "prediction",
            "web_search_options",
        ),
    )
    if body.get("modalities") not in (None, ["text"]):
        raise unsupported("modalities", " (text only)")
    messages = _messages(body.get("messages"))
    values = _sampling(body)
    if (m := _max_tokens(body, "max_tokens", "max_completion_tokens")) is not None:
        values["max_tokens"] = m
    logprobs = _chat_logprobs(body)
    if logprobs is not None:
        values["logprobs"] = logprobs
    if (c := response_format(body.get("response_format"))) is not None:
        values["constraint"] = c
    stream, usage = _stream(body)
    tools, choice = _tools(body)
    if "constraint" in values and choice.mode != "none":
        raise bad("'response_format' and 'tools' cannot both constrain the reply", "response_format")
    ask = Ask("chat", _model(body), _n(body), stream, usage, logprobs, values, messages=messages)
    ask.tools, ask.tool_choice = tools, choice
    ask.template_vars = _template_vars(body, values)
    return ask


def _template_vars(body: dict, values: dict) -> dict:
    """chat_template_kwargs (its enable_thinking, and reasoning_effort, into values' think and
    reasoning_budget): a model that does not think ignores both, as vLLM's server does."""
    level = body.get("reasoning_effort")
    if level is not None:
        if level not in EFFORT:
            raise bad(f"invalid 'reasoning_effort': {level!r}, expected one of {', '.join(EFFORT)}", "reasoning_effort")
        values["think"], values["reasoning_budget"] = effort(level)
    v = body.get("chat_template_kwargs")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad(f"invalid 'chat_template_kwargs': expected an object, got {_type_name(v)}", "chat_template_kwargs")
    if taken := sorted(RESERVED & set(v)):
        raise bad(f"invalid 'chat_template_kwargs': {taken[0]!r} is set by localkv", "chat_template_kwargs")
    if "enable_thinking" in v:
        values["think"] = flag(v, "enable_thinking")
    return dict(v)


def _tools(body: dict) -> tuple[list[Tool] | None, Choice]:
    try:
        v = body.get("tools")
        tools = read_tools(v) if v not in (None, []) else None
        return tools, read_choice(body.get("tool_choice"), tools, body.get("parallel_tool_calls"))
    except ToolError as e:
        raise bad(str(e), e.param) from None


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _messages(v) -> list[dict]:
    if v is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(v, list) or not v:
        raise bad("invalid 'messages': expected a non-empty array of messages", "messages")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"invalid '{where}': expected an object, got {_type_name(m)}", where)
        role = m.get("role")
        if role == "function":
            raise unsupported(f"{where}.role", " (function messages: use 'tool' messages)")
        if role not in ROLES:
            raise bad(f"invalid '{where}.role': {role!r}, expected one of {', '.join(ROLES)}", f"{where}.role")
        msg = {"role": ROLES[role], "content": _content(m.get("content"), role, f"{where}.content")}
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad(f"invalid '{where}.tool_call_id': expected a string", f"{where}.tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        elif m.get("tool_calls") and role == "assistant":
            msg["tool_calls"] = _calls(m["tool_calls"], f"{where}.tool_calls")
        elif m.get("tool_calls"):
            raise bad(f"invalid '{where}.tool_calls': only assistant messages make tool calls", f"{where}.tool_calls")
        out.append(msg)
    return out


def _calls(v, where: str) -> list[dict]:
    """An assistant turn's tool_calls: id, name and arguments (a JSON object's text)."""
    if not isinstance(v, list):
        raise bad(f"invalid '{where}': expected an array of tool calls", where)
    calls = []
    for j, c in enumerate(v):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(c.get("id"), str):
            raise bad(f"invalid '{where}[{j}]': expected an id and a function with a name", f"{where}[{j}]")
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            args = None
        if not isinstance(args, dict):
            raise bad(f"invalid '{where}[{j}].function.arguments': expected a JSON object's text", f"{where}[{j}]")
        calls.append({"id": c["id"], "name": fn["name"], "arguments": args})
    return calls


def _content(v, role: str, where: str) -> str:
    if v is None and role == "assistant":
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        texts = []
        for j, part in enumerate(v):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad(f"invalid '{where}[{j}]': expected a content part object with a 'type'", f"{where}[{j}]")
            if part["type"] != "text":
                raise unsupported(f"{where}[{j}].type", f" ({part['type']!r} content: text only)")
            if not isinstance(part.get("text"), str):
                raise bad(f"invalid '{where}[{j}].text': expected a string", f"{where}[{j}].text")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"invalid '{where}': expected a string or an array of text parts, got {_type_name(v)}", where)


def _chat_logprobs(body: dict) -> int | None:
    want = flag(body, "logprobs")
    top = number(body, "top_logprobs", 0, MAX_LOGPROBS, integer=True)
    if top is not None and not want:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if want else None


def response_format(v) -> Constraint | None:
    """OpenAI's response_format -> a Constraint (None: free text)."""
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise bad("invalid 'response_format': expected an object with a 'type'", "response_format")
    kind = v["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json")
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad(
                "invalid 'response_format.json_schema': expected an object with a 'schema' object",
                "response_format.json_schema",
            )
        return Constraint("json_schema", json.dumps(spec.get("schema", {"type": "object"})), "response_format")
    raise bad(
        f"invalid 'response_format.type': {kind!r}, expected text, json_object or json_schema", "response_format.type"
    )


# ------------------------------------------------------------------ completions


def parse_completion(body) -> Ask:
    body = _object(body)
    _refuse(body, ("logit_bias", "suffix"))
    if flag(body, "echo"):
        raise unsupported("echo")
    n = _n(body)
    best_of = number(body, "best_of", 1, MAX_N, integer=True)
    if best_of is not None and best_of != n:
        raise unsupported("best_of", " (other than n)")
    values = _sampling(body)
    values["max_tokens"] = _max_tokens(body, "max_tokens") or 16  # OpenAI's default for completions
    logprobs = number(body, "logprobs", 0, MAX_LOGPROBS, integer=True)
    if logprobs is not None:
        values["logprobs"] = logprobs
    if (c := response_format(body.get("response_format"))) is not None:
        values["constraint"] = c
    stream, usage = _stream(body)
    return Ask("completion", _model(body), n, stream, usage, logprobs, values, prompts=_prompts(body.get("prompt")))


def _prompts(v) -> list:
    """A string, an array of strings, an array of token ids, or an array of arrays of ids."""
    if v is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v:
        if all(isinstance(x, str) for x in v):
            return list(v)
        if all(_is_id(x) for x in v):
            return [list(v)]
        if all(isinstance(x, list) and x and all(_is_id(t) for t in x) for x in v):
            return [list(x) for x in v]
    raise bad("invalid 'prompt': expected a string, an array of strings, or token ids", "prompt")


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
