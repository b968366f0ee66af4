"""Ollama's HTTP API as localkv reads it (the clients that speak only it: the `ollama` package,
Open WebUI, editor plugins): /api/chat and /api/generate bodies checked into a Call holding the
same Ask as OpenAI's (openai.py), which takes the same path (jobs.py), and their answers as
NDJSON lines (Ollama streams by default) or a whole body; the routes are ollama_routes.py.

What a one-model server makes of Ollama's model management: the model loaded is the only one
listed, never unloaded or expiring; an empty request answers "load" (or "unload" with
`keep_alive: 0`) and changes nothing. `options` are localkv's sampling, `num_predict` its
max_tokens (-1, -2: to the context's end, Ollama's default) and `num_ctx` the request's context
window (the server's own at most: Ollama would reload the model, localkv serves one context).
Ollama's load-time options (threads, GPU layers, mmap) are localkv's flags, ignored here, and
an option Ollama does not know is ignored with a warning on the server's stderr, as Ollama does.
`tools` go through localkv.toolcalls as OpenAI's do (tool_choice "auto"); a reply that may call
a tool is sent whole at its end, calls parsed out. `think` (true, false, or a level: "low",
"medium", "high", as reasoning.EFFORT budgets them) turns a thinking model's thinking on or
off, answered in `message.thinking` (/api/generate: `thinking`); think: true on a model that
does not think is refused, as Ollama does."""

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from localkv.events import Delta, Event, Finished
from localkv.reasoning import effort
from localkv.sampling import Constraint
from localkv.serve.openai import Ask, bad, flag, number
from localkv.serve.openai import _type_name as type_name
from localkv.serve.replies import finish_reason
from localkv.toolcalls import Choice, Plan, Tool, ToolError, read_choice, read_tools

NDJSON = "application/x-ndjson"
# Ollama's options that set up its runner (threads, GPU layers, memory mapping): localkv's flags
LOAD_OPTIONS = {
    "num_keep", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "vocab_only", "use_mmap",
    "use_mlock", "numa", "num_thread", "embedding_only", "logits_all",
}  # fmt: skip
# Ollama's sampling options localkv has no sampler for: refused unless they ask for nothing
NEUTRAL = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0, "penalize_newline": False}
SAMPLING = {  # option: (lowest, highest, integer)
    "temperature": (0, None, False),
    "top_k": (0, None, True),
    "top_p": (0, 1, False),
    "min_p": (0, 1, False),
    "repeat_penalty": (0, None, False),
    "repeat_last_n": (-1, None, True),
    "presence_penalty": (None, None, False),
    "frequency_penalty": (None, None, False),
    "dry_multiplier": (0, None, False),
    "dry_base": (1, None, False),
    "dry_allowed_length": (0, None, True),
    "dry_penalty_last_n": (-1, None, True),
}
KNOWN = LOAD_OPTIONS | set(NEUTRAL) | set(SAMPLING) | {"mirostat_tau", "mirostat_eta", "seed", "stop"}
KNOWN |= {"num_predict", "num_ctx"}
DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(slots=True)
class Call:
    """A checked /api/chat or /api/generate body: the model it names, and what to run (None: an
    empty request, which loads the model, or unloads it with keep_alive 0)."""

    model: str
    ask: Ask | None
    keep_alive: float  # seconds; math.inf: for ever


# ------------------------------------------------------------------ bodies


def parse_chat(body, warn: Callable[[str], None]) -> Call:
    body, model = _head(body)
    tools = _tools(body.get("tools"))
    messages = body.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise bad(f"invalid 'messages': expected an array of messages, got {type_name(messages)}")
    keep = keep_alive(body.get("keep_alive"))
    if not messages:
        return Call(model, None, keep)
    msgs = _answered([_message(i, m) for i, m in enumerate(messages)])
    ask = _ask("chat", body, model, warn, messages=msgs)
    if tools is not None and ask.values.get("constraint") is not None:
        raise bad("'format' and 'tools' cannot both constrain the reply")
    ask.tools, ask.tool_choice = tools, _choice(tools)
    return Call(model, ask, keep)


def _tools(v) -> list[Tool] | None:
    """Ollama's `tools`: OpenAI's function tools."""
    if v in (None, []):
        return None
    try:
        return read_tools(v)
    except ToolError as e:
        raise bad(str(e)) from None


def _choice(tools: list[Tool] | None) -> Choice:
    return read_choice(None, tools)  # Ollama has no tool_choice: auto with tools


def _answered(msgs: list[dict]) -> list[dict]:
    """The history with ids: each assistant call gets one, and each tool result the id of the
    earliest unanswered call of its `tool_name` (else of the earliest unanswered call)."""
    open_calls: list[dict] = []
    for i, m in enumerate(msgs):
        for j, c in enumerate(m.get("tool_calls", ())):
            c["id"] = f"call_{i}_{j}"
            open_calls.append(c)
        if m["role"] == "tool":
            name = m.pop("tool_name", None)
            match = next((c for c in open_calls if name is None or c["name"] == name), None)
            if match is None:
                raise bad(f"invalid 'messages[{i}]': a tool result with no tool call before it to answer")
            open_calls.remove(match)
            m["tool_call_id"] = match["id"]
    return msgs


def parse_generate(body, warn: Callable[[str], None]) -> Call:
    body, model = _head(body)
    for name in ("template", "suffix", "context", "images"):
        if body.get(name):
            raise bad(f"'{name}' is not supported by localkv's /api/generate")
    prompt, system = body.get("prompt"), body.get("system")
    for name, v in (("prompt", prompt), ("system", system)):
        if v is not None and not isinstance(v, str):
            raise bad(f"invalid '{name}': expected a string, got {type_name(v)}")
    keep = keep_alive(body.get("keep_alive"))
    if not prompt:
        return Call(model, None, keep)
    if flag(body, "raw"):  # the prompt as it is, no chat template
        if system:
            raise bad("'system' needs the chat template, which 'raw' turns off")
        return Call(model, _ask("completion", body, model, warn, prompts=[prompt]), keep)
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return Call(model, _ask("chat", body, model, warn, messages=msgs), keep)


def _head(body) -> tuple[dict, str]:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type_name(body)}")
    model = body.get("model")
    if not model:
        raise bad("model is required")
    if not isinstance(model, str):
        raise bad(f"invalid 'model': expected a string, got {type_name(model)}")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad("'logprobs' is not supported by localkv's Ollama API (use /v1/chat/completions)")
    return body, model


def _ask(kind: str, body: dict, model: str, warn, **what) -> Ask:
    values, window = _options(body.get("options"), warn)
    if (c := _format(body.get("format"))) is not None:
        values["constraint"] = c
    stream = flag(body, "stream", default=True)  # Ollama streams unless told not to
    ask = Ask(kind, model, 1, stream, False, None, values, window=window, **what)
    ask.thinking_asked = _think(body.get("think"), values) and kind == "chat"
    return ask


def _think(v, values: dict) -> bool:
    """Ollama's think into values (think, reasoning_budget); whether it asked for thinking."""
    if v is None:
        return False
    if isinstance(v, bool):
        values["think"] = v
        return v
    if v not in ("low", "medium", "high"):
        raise bad(f'invalid think value: {json.dumps(v)} (expected true, false, "low", "medium" or "high")')
    values["think"], values["reasoning_budget"] = effort(v)
    return True


def _message(i: int, m) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"invalid '{where}': expected an object, got {type_name(m)}")
    role, content = m.get("role"), m.get("content")
    if role not in ("system", "user", "assistant", "tool"):
        raise bad(f"invalid '{where}.role': {role!r}, expected system, user, assistant or tool")
    if m.get("images"):
        raise bad(f"invalid '{where}.images': localkv's models read text only")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise bad(f"invalid '{where}.content': expected a string, got {type_name(content)}")
    msg = {"role": role, "content": content}  # an earlier turn's `thinking` is not shown to the model again
    if role == "tool" and m.get("tool_name") is not None:
        if not isinstance(m["tool_name"], str):
            raise bad(f"invalid '{where}.tool_name': expected a string, got {type_name(m['tool_name'])}")
        msg["tool_name"] = m["tool_name"]
    if m.get("tool_calls"):
        if role != "assistant":
            raise bad(f"invalid '{where}.tool_calls': only assistant messages make tool calls")
        msg["tool_calls"] = _calls(m["tool_calls"], f"{where}.tool_calls")
    return msg


def _calls(v, where: str) -> list[dict]:
    """An assistant turn's tool_calls, Ollama's way: {"function": {"name", "arguments": {...}}}."""
    if not isinstance(v, list):
        raise bad(f"invalid '{where}': expected an array of tool calls, got {type_name(v)}")
    calls = []
    for j, c in enumerate(v):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"invalid '{where}[{j}]': expected a function with a name")
        args = fn.get("arguments", {})
        if isinstance(args, str):  # some clients send OpenAI's JSON text
            try:
                args = json.loads(args or "{}")
            except ValueError:
                args = None
        if not isinstance(args, dict):
            raise bad(f"invalid '{where}[{j}].function.arguments': expected an object")
        calls.append({"name": fn["name"], "arguments": args})
    return calls


def _options(opts, warn) -> tuple[dict, int]:
    """Ollama's options -> SamplingParams fields, and the request's context window (0: the server's)."""
    if opts is None:
        return {}, 0
    if not isinstance(opts, dict):
        raise bad(f"invalid 'options': expected an object, got {type_name(opts)}")
    for name in sorted(set(opts) - KNOWN):
        warn(f"localkv serve: invalid option provided: {name!r} (ignored, as Ollama does)")
    for name, neutral in NEUTRAL.items():
        if opts.get(name) not in (None, neutral):
            raise bad(f"option '{name}' is not supported by localkv (only {json.dumps(neutral)})")
    values = {name: number(opts, name, lo, hi, integer) for name, (lo, hi, integer) in SAMPLING.items()}
    if values["top_p"] == 0 or values["repeat_penalty"] == 0:
        raise bad("invalid options: 'top_p' and 'repeat_penalty' must be > 0")
    seed = number(opts, "seed", None, None, integer=True)
    values["seed"] = seed if seed is not None and seed >= 0 else None  # Ollama's -1: a random seed
    values["stop"] = _stops(opts.get("stop"))
    n = number(opts, "num_predict", -2, None, integer=True)
    values["max_tokens"] = n if n is not None and n > 0 else None  # -1, -2, 0: to the context's end
    window = number(opts, "num_ctx", 1, None, integer=True) or 0
    return {k: v for k, v in values.items() if v is not None}, window


def _stops(v) -> tuple[str, ...] | None:
    if v is None:
        return None
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("invalid option 'stop': expected an array of non-empty strings")
    return tuple(stops) or None


def _format(v) -> Constraint | None:
    if v in (None, ""):
        return None
    if v == "json":
        return Constraint("json")
    if isinstance(v, dict):
        return Constraint("json_schema", json.dumps(v), "format")
    raise bad('invalid format: expected "json" or a JSON schema')


def keep_alive(v) -> float:
    """Ollama's keep_alive in seconds: a number of seconds, or a Go duration ("5m", "1h30m");
    negative: for ever. None: Ollama's default, five minutes."""
    if v is None:
        return 300.0
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return math.inf if v < 0 else float(v)
    if isinstance(v, str):
        sign, text = (-1, v[1:]) if v.startswith("-") else (1, v.lstrip("+"))
        if text == "0":
            return 0.0
        if text and DURATION.sub("", text) == "":
            seconds = sum(float(n) * UNITS[u] for n, u in DURATION.findall(text))
            return math.inf if sign < 0 else seconds
    raise bad(f"invalid 'keep_alive': {json.dumps(v)} is not a duration (seconds, or like \"5m\")")


# ------------------------------------------------------------------ answers


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass(slots=True)
class Answer:
    """One request's NDJSON lines or whole body, rendered from its events."""

    api: str  # chat | generate: whose shape
    model: str
    t0: float  # perf_counter() when the request came
    tools: Plan | None = None  # a chat that may call tools: its reply is sent whole, calls parsed
    held: list[str] = field(default_factory=list)  # that reply's text so far
    held_thinking: list[str] = field(default_factory=list)  # and its thinking

    def _said(self, text: str, thinking: str = "") -> dict:
        if self.api == "chat":
            message = {"role": "assistant", "content": text} | ({"thinking": thinking} if thinking else {})
            return {"message": message}
        return {"response": text} | ({"thinking": thinking} if thinking else {})

    def piece(self, text: str, thinking: str = "") -> dict:
        return {"model": self.model, "created_at": now(), **self._said(text, thinking), "done": False}

    def last(self, fin: Finished, text: str = "", thinking: str = "") -> dict:
        """The answer's last object: the rest of the text, why it ended and what it took (ns)."""
        total = time.perf_counter() - self.t0
        u = fin.usage
        return {
            "model": self.model,
            "created_at": now(),
            **self._said(text, thinking),
            "done": True,
            "done_reason": finish_reason(fin.reason),
            "total_duration": int(total * 1e9),
            "load_duration": 0,  # the model was in before the request came
            "prompt_eval_count": u.prompt_tokens,
            "prompt_eval_duration": int(fin.ttft_s * 1e9),
            "eval_count": u.completion_tokens,
            "eval_duration": int(max(total - fin.ttft_s, 0.0) * 1e9),
        }

    def body(self, events: list[Event]) -> dict:
        text = "".join(ev.text for ev in events if isinstance(ev, Delta))
        thinking = "".join(ev.reasoning for ev in events if isinstance(ev, Delta))
        fin = next(ev for ev in events if isinstance(ev, Finished))
        return self._called(self.last(fin, text, thinking))

    def _called(self, obj: dict) -> dict:
        """obj with its text's tool calls parsed out into message.tool_calls (a tools chat)."""
        if self.tools is None or self.tools.constraint is None:
            return obj
        content, calls = self.tools.parse(obj["message"]["content"])
        obj["message"]["content"] = content
        if calls:
            obj["message"]["tool_calls"] = [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return obj

    def lines(self, events: list[Event]) -> str:
        """The NDJSON lines of a batch of events; a reply that may call tools is held (self.held)
        and sent in its last line, with the calls parsed."""
        out = []
        holding = self.tools is not None and self.tools.constraint is not None
        for ev in events:
            if isinstance(ev, Delta) and (ev.text or ev.reasoning):
                if holding:
                    self.held.append(ev.text)
                    self.held_thinking.append(ev.reasoning)
                else:
                    out.append(self.piece(ev.text, ev.reasoning))
            elif isinstance(ev, Finished):
                whole = "".join(self.held), "".join(self.held_thinking)
                out.append(self._called(self.last(ev, *whole)) if holding else self.last(ev))
        return "".join(line(o) for o in out)


def line(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"
