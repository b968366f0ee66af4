"""Ollama's routes (ollama.py reads the bodies and renders the answers): /api/chat and
/api/generate through the same path as OpenAI's (jobs.py), and what /api/tags, /api/show and
/api/ps say of the one model, read once from its file. Errors in Ollama's shape."""

import hashlib
import time
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localkv import reasoning
from localkv.hub.info import describe
from localkv.serve.jobs import EventStream, authorize, failure, read_json, ready, submit, tool_plan, whole
from localkv.serve.ollama import NDJSON, Answer, line, now, parse_chat, parse_generate
from localkv.serve.openai import ApiError, bad
from localkv.serve.runner import Job

NEVER = "9999-12-31T23:59:59Z"  # /api/ps: this server's model does not expire


async def _lines(job: Job, answer: Answer):
    async for batch in job.batches():
        events, failed = failure(batch, job)
        text = answer.lines(events)
        if failed is not None:  # Ollama ends a broken stream with an error object
            yield text + line({"error": failed.message})
            return
        if text:
            yield text


# ------------------------------------------------------------------ routes


def ollama_errors(handler):
    """The route with errors in Ollama's shape: {"error": "..."} and the status."""

    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as e:
            headers = {"Retry-After": "1"} if e.status in (429, 503) else None
            return JSONResponse({"error": e.message}, status_code=e.status, headers=headers)
        except Exception as e:  # a bug: one line in the log, one JSON error to the client
            request.app.state.runner.log(f"localkv serve: internal error on {request.url.path}: {e!r}")
            return JSONResponse({"error": f"internal error: {type(e).__name__}: {e}"}, status_code=500)

    return route


async def chat(request: Request) -> Response:
    return await _run(request, "chat", parse_chat)


async def generate(request: Request) -> Response:
    return await _run(request, "generate", parse_generate)


async def _run(request: Request, api: str, parse) -> Response:
    t0 = time.perf_counter()
    authorize(request)
    runner = ready(request)
    call = parse(await read_json(request), runner.log)
    name = _check(request, call.model)
    if call.ask is None:
        done = "unload" if call.keep_alive == 0 else "load"
        said = Answer(api, name, t0)._said("")
        return JSONResponse({"model": name, "created_at": now(), **said, "done_reason": done, "done": True})
    ask = call.ask
    plan = tool_plan(ask, runner.engine.tokenizer)
    job = await submit(runner, ask, plan)
    answer = Answer(api, name, t0, plan)
    if ask.stream:
        return EventStream(_lines(job, answer), runner, job, NDJSON)
    events = await whole(request, runner, job)
    if events is None:
        return Response(status_code=499)  # nobody reads it; the job is cancelled
    return JSONResponse(answer.body(events))


def served_name(request: Request) -> str:
    """The model's name in Ollama's NAME:TAG form."""
    mid = request.app.state.model_id
    return mid if ":" in mid else f"{mid}:latest"


def _check(request: Request, name: str) -> str:
    """The served model's Ollama name when `name` is one of its names; else Ollama's 404."""
    runner = request.app.state.runner
    known = {request.app.state.model_id, runner.config.model, served_name(request)}
    if runner.engine is not None:
        known.add(runner.engine.model_config.name)
    if name not in known and name.removesuffix(":latest") not in known:
        raise ApiError(404, f'model "{name}" not found, try pulling it first')
    return served_name(request)


async def _card(request: Request) -> tuple[dict, str]:
    """What /api/tags, /api/show and /api/ps say of the model, and its file's time (read once, off
    the event loop)."""
    state = request.app.state
    if getattr(state, "ollama_card", None) is None:
        state.ollama_card = await run_in_threadpool(_read_card, Path(ready(request).engine.path))
    return state.ollama_card


def _read_card(path: Path) -> tuple[dict, str]:
    info = describe(str(path))
    params = info.get("parameters") or 0
    details = {
        "parent_model": "",
        "format": "gguf" if path.is_file() else "safetensors",
        "family": info.get("architecture"),
        "families": [info.get("architecture")],
        "parameter_size": f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.2f}M",
        "quantization_level": info.get("quantization"),
    }
    stamp = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat().replace("+00:00", "Z")
    return {"info": info, "details": details, "size": info.get("file_size") or 0, "digest": _digest(path)}, stamp


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in [path] if path.is_file() else sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def _listing(request: Request, card: dict, stamp: str) -> dict:
    name = served_name(request)
    return {"name": name, "model": name, "modified_at": stamp, "size": card["size"], "digest": card["digest"]} | {
        "details": card["details"]
    }


async def tags(request: Request) -> JSONResponse:
    authorize(request)
    return JSONResponse({"models": [_listing(request, *await _card(request))]})


async def ps(request: Request) -> JSONResponse:
    authorize(request)
    card, stamp = await _card(request)
    runner = request.app.state.runner
    on_gpu = runner.engine.backend.xp is not np
    loaded = {"expires_at": NEVER, "size_vram": card["size"] if on_gpu else 0, "context_length": runner.engine.ctx}
    return JSONResponse({"models": [_listing(request, card, stamp) | loaded]})


async def show(request: Request) -> JSONResponse:
    authorize(request)
    body = await read_json(request)
    if not isinstance(body, dict) or not (body.get("model") or body.get("name")):
        raise bad("model is required")
    name = body.get("model") or body.get("name")
    try:
        _check(request, str(name))
    except ApiError:
        raise ApiError(404, f"model '{name}' not found") from None
    (card, stamp) = await _card(request)
    info = card["info"]
    arch = info.get("architecture")
    defaults = info.get("sampling_defaults") or {}
    parameters = "\n".join(f"{k:<15} {v}" for k, v in defaults.items())
    model_info = {"general.architecture": arch, "general.parameter_count": info.get("parameters")}
    model_info |= {f"{arch}.{k}": info.get(k) for k in ("context_length", "embedding_length") if info.get(k)}
    return JSONResponse(
        {
            "modelfile": f"FROM {info.get('path')}\n" + "".join(f"PARAMETER {k} {v}\n" for k, v in defaults.items()),
            "parameters": parameters,
            "template": info.get("chat_template") or "",  # the GGUF's Jinja template, not a Go one
            "license": info.get("license") or "",
            "details": card["details"],
            "model_info": model_info,
            "capabilities": ["completion", *(["thinking"] if reasoning.family(info.get("chat_template")) else [])],
            "modified_at": stamp,
        }
    )


async def api_version(request: Request) -> JSONResponse:
    try:
        return JSONResponse({"version": version("localkv")})
    except PackageNotFoundError:  # run from a source tree
        return JSONResponse({"version": "0.0.0"})


def routes() -> list[Route]:
    return [
        Route("/api/chat", ollama_errors(chat), methods=["POST"]),
        Route("/api/generate", ollama_errors(generate), methods=["POST"]),
        Route("/api/tags", ollama_errors(tags), methods=["GET"]),
        Route("/api/show", ollama_errors(show), methods=["POST"]),
        Route("/api/ps", ollama_errors(ps), methods=["GET"]),
        Route("/api/version", ollama_errors(api_version), methods=["GET", "HEAD"]),
    ]
