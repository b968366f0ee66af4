"""Issue 34's tool-call targets, measured on a real model through `localkv serve` and the openai
client: how many calls parse and match their function's schema with tool_choice `required`
(every request must call), and with `auto` how many of the calls the model chose to emit do.

    python scripts/tool_call_rates.py [-m MODEL] [-n 100] [--auto 40] [--temperature 0.8]

Each request is its own question and seed; the table says requests, calls emitted, calls that
parse and validate, replies cut by max_tokens, and the wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

from localkv.config import EngineConfig
from localkv.hub.pull import ensure_model
from localkv.serve.app import model_id
from localkv.serve.server import BackgroundServer

# enums, a nested object, an array, required fields (tests/serve/test_tools.py uses these too)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 7}, "maxItems": 3},
        "where": {
            "type": "object",
            "properties": {"country": {"type": "string", "maxLength": 40}},
            "required": ["country"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "unit", "where"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 40}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": f"{n.replace('_', ' ')} somewhere", "parameters": s}}
    for n, s in SCHEMAS.items()
]
PROMPTS = [
    "What is the weather in {c}?",
    "Tell me the time in {c}.",
    "Is it raining in {c} this week?",
    "I am flying to {c} tomorrow: what should I pack?",
    "What time is it now in {c}?",
]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Dakar", "Hanoi", "Leeds"]


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)].format(c=CITIES[i // len(PROMPTS) % len(CITIES)])}]


def after_a_call(i: int) -> list[dict]:
    """A second question in a conversation that already made a call and got its result (where a
    model left to choose calls most often)."""
    city = CITIES[(i + 1) % len(CITIES)]
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "get_time", "arguments": json.dumps({"zone": city})},
    }
    return [
        {"role": "user", "content": f"What time is it in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "10:42"},
        *question(i),
    ]


def valid(call) -> bool:
    try:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        return True
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


def measure(client, model: str, choice: str, n: int, temperature: float, max_tokens: int, history=False) -> dict:
    def one(i: int):
        return client.chat.completions.create(
            model=model, messages=after_a_call(i) if history else question(i), tools=TOOLS, tool_choice=choice,
            temperature=temperature, seed=i, max_tokens=max_tokens,
        ).choices[0]  # fmt: skip

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(one, range(n)))
    calls = [c for r in replies for c in r.message.tool_calls or ()]
    cut = sum(r.finish_reason == "length" for r in replies)
    # with auto, a reply cut inside a call still emitted it (its text holds the trigger)
    broken = sum(r.finish_reason == "length" and '{"tool_calls"' in (r.message.content or "") for r in replies)
    return {
        "choice": choice + (" after a call" if history else ""),
        "requests": n,
        "calling": sum(bool(r.message.tool_calls) for r in replies),
        "calls": len(calls) + broken,
        "valid": sum(valid(c) for c in calls),
        "cut by max_tokens": cut,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-n", type=int, default=100, help="requests with tool_choice required")
    ap.add_argument("--auto", type=int, default=40, help="requests with tool_choice auto")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=160)
    a = ap.parse_args(argv)
    path = ensure_model(a.model, progress=False)
    rows = []
    with BackgroundServer(EngineConfig(model=str(path), disk_cache=False, kv_mem="512MiB")) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=600)
        for choice, n, history in (("required", a.n, False), ("auto", a.auto, False), ("auto", a.auto, True)):
            if n:
                rows.append(measure(client, model_id(str(path)), choice, n, a.temperature, a.max_tokens, history))
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + " --- |" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    return 0 if all(r["valid"] == r["calls"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
