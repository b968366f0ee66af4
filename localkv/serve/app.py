"""The HTTP routes (Starlette): OpenAI's chat and text completions, streamed as server-sent
events or whole, the model list, /health and /metrics; Ollama's API beside them
(ollama_routes.py). Each request is checked (openai.py), turned into Generations off the event
loop, handed to the Runner, and answered from the events the engine's thread pushes onto the
request's Job (jobs.py: the routes never read a Generation). A client that goes away is cancelled at once: its blocks go
back to the pool at the next step."""

import asyncio
import contextlib
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from localkv.hub.catalog import DEFAULT_MODEL
from localkv.hub.ollama_store import OllamaRef, is_ollama
from localkv.serve import metrics, ollama_routes
from localkv.serve.jobs import (
    EventStream,
    authorize,
    failure,
    read_json,
    ready,
    render,
    submit,
    tool_plan,
    unavailable,
    whole,
)
from localkv.serve.openai import ApiError, Ask, parse_chat, parse_completion
from localkv.serve.replies import DONE, Reply, sse
from localkv.serve.runner import Job, Runner


def model_id(model: str | None) -> str:
    """The name /v1/models lists: the catalog name, an Ollama model's NAME:TAG, or the file's or
    folder's name without .gguf."""
    if model is None:
        return DEFAULT_MODEL
    if is_ollama(model):
        return OllamaRef.parse(model).short
    p = Path(model)
    return p.stem if p.suffix.lower() == ".gguf" else p.name or model


def create_app(runner: Runner, api_key: str | None = None) -> Starlette:
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        *(Route(path, model_info, methods=["GET"]) for path in ("/model_info", "/get_model_info")),
        *(Route(path, server_info, methods=["GET"]) for path in ("/server_info", "/get_server_info")),
        Route("/v1/chat/completions/render", render_chat, methods=["POST"]),
        Route("/v1/completions/render", render_completion, methods=["POST"]),
        *ollama_routes.routes(),  # Ollama's API, its own error shape
    ]
    handlers = {HTTPException: _http_error, ApiError: _api_error, Exception: _internal_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=_lifespan)
    app.state.runner, app.state.api_key = runner, api_key
    app.state.model_id = model_id(runner.config.model)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette):
    runner: Runner = app.state.runner
    runner.start()  # the socket listens once startup returns; /health says 503 until the model is in
    yield
    await run_in_threadpool(runner.close)


# ------------------------------------------------------------------ errors


def _error(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _api_error(request: Request, e: ApiError) -> JSONResponse:
    return _error(e)


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    if e.status_code == 404:
        return _error(ApiError(404, f"no such endpoint: {request.method} {request.url.path}", code="not_found"))
    return _error(ApiError(e.status_code, str(e.detail), code="method_not_allowed" if e.status_code == 405 else None))


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    request.app.state.runner.log(f"localkv serve: internal error on {request.url.path}: {type(e).__name__}: {e}")
    return _error(ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"))


# ------------------------------------------------------------------ small routes


async def health(request: Request) -> JSONResponse:
    runner: Runner = request.app.state.runner
    e = unavailable(runner)
    if e is None:
        return JSONResponse({"status": "ok", "model": request.app.state.model_id})
    status = "stopping" if runner.draining else runner.state
    return JSONResponse(e.body() | {"status": status}, status_code=503, headers={"Retry-After": "1"})


async def metrics_route(request: Request) -> PlainTextResponse:
    authorize(request)
    runner: Runner = request.app.state.runner
    snap = await asyncio.wrap_future(runner.call(runner.snapshot)) if runner.ready else None
    return PlainTextResponse(metrics.render(runner.counters, snap), media_type="text/plain; version=0.0.4")


def _model_card(request: Request) -> dict:
    runner: Runner = request.app.state.runner
    return {"id": request.app.state.model_id, "object": "model", "created": int(runner.created), "owned_by": "localkv"}


async def list_models(request: Request) -> JSONResponse:
    authorize(request)
    return JSONResponse({"object": "list", "data": [_model_card(request)]})


async def get_model(request: Request) -> JSONResponse:
    authorize(request)
    _check_model(request, request.path_params["model"])
    return JSONResponse(_model_card(request))


async def model_info(request: Request) -> JSONResponse:
    """SGLang's worker info, which sglang-router reads to name the model it lists at /v1/models
    (without it, it lists 'unknown', and clients that take the name from there get 404s). The
    name is known before the model loads; the rest once it has."""
    authorize(request)
    runner: Runner = request.app.state.runner
    info = _names(request) | {"is_generation": True}
    if runner.ready:
        cfg = runner.engine.model_config
        info |= {"model_type": cfg.arch, "max_context_length": runner.engine.ctx, "vocab_size": cfg.vocab_size}
    return JSONResponse(info)


async def server_info(request: Request) -> JSONResponse:
    authorize(request)
    runner: Runner = request.app.state.runner
    info = _names(request) | {"tp_size": 1, "dp_size": 1, "max_running_requests": runner.opts.max_seqs}
    if runner.ready:
        info["kv_block_size"] = runner.engine.block_size
    return JSONResponse(info)


def _names(request: Request) -> dict:
    name = request.app.state.model_id
    return {"model_path": name, "tokenizer_path": name, "served_model_name": name}


def _check_model(request: Request, name: str | None):
    """A request for another model is a 404; no model named means this one."""
    if name is None:
        return
    runner: Runner = request.app.state.runner
    known = {request.app.state.model_id, runner.config.model}
    if runner.engine is not None:
        known.add(runner.engine.model_config.name)
    if name not in known:
        raise ApiError(
            404,
            f"the model '{name}' does not exist: this server serves '{request.app.state.model_id}'",
            "model",
            "model_not_found",
        )


# ------------------------------------------------------------------ completions


async def chat_completions(request: Request) -> Response:
    authorize(request)
    return await _answer(request, parse_chat(await read_json(request)))


async def completions(request: Request) -> Response:
    authorize(request)
    return await _answer(request, parse_completion(await read_json(request)))


async def render_chat(request: Request) -> JSONResponse:
    """vLLM's render: the prompt's token ids as this server would compute them (a KV-aware
    router hashes them into blocks to find the node holding them)."""
    authorize(request)
    return JSONResponse((await _render(request, parse_chat(await read_json(request))))[0])


async def render_completion(request: Request) -> JSONResponse:
    authorize(request)
    return JSONResponse(await _render(request, parse_completion(await read_json(request))))


async def _render(request: Request, ask: Ask) -> list[dict]:
    runner = ready(request)
    _check_model(request, ask.model)
    plan = tool_plan(ask, runner.engine.tokenizer)
    _, prompts, _ = await run_in_threadpool(render, runner.engine, ask, plan, runner.opts.defaults)
    return [{"model": request.app.state.model_id, "token_ids": ids} for ids in prompts]


async def _answer(request: Request, ask: Ask) -> Response:
    runner = ready(request)
    _check_model(request, ask.model)
    plan = tool_plan(ask, runner.engine.tokenizer)
    job = await submit(runner, ask, plan)
    reply = Reply(ask.kind, request.app.state.model_id, runner.engine.tokenizer, ask.logprobs is not None, tools=plan)
    if ask.stream:
        return EventStream(_events(job, reply, ask), runner, job)
    events = await whole(request, runner, job)
    if events is None:
        return Response(status_code=499)  # nobody reads it; the job is cancelled
    return JSONResponse(reply.body(events))


async def _events(job: Job, reply: Reply, ask: Ask):
    """The SSE stream: a role chunk per choice (chat), text as it comes, each choice's finish
    reason, the usage if asked, [DONE]. A step that failed ends it with an error event."""
    if ask.kind == "chat":
        yield reply.roles(len(job.gens) * ask.n)
    async for batch in job.batches():
        events, failed = failure(batch, job)
        text = reply.stream(events)
        if failed is not None:
            yield text + sse(failed.body()) + DONE
            return
        if text:
            yield text
    yield reply.end(ask.include_usage)
