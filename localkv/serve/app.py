"""The HTTP routes (Starlette): OpenAI's chat and text completions, streamed as server-sent
events or whole, the model list, /health and /metrics. Each request is checked (openai.py),
turned into Generations off the event loop (tokenizing a long prompt takes a while), handed to
the Runner, and answered from the events the engine's thread pushes onto the request's Job (the
routes never read a Generation). A client that goes away is cancelled at once: its blocks go
back to the pool at the next step."""

import asyncio
import contextlib
import hmac
import json
from pathlib import Path

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from localkv.errors import ContextOverflow, LocalkvError, PoolExhausted
from localkv.events import Event, Failed
from localkv.generation import Generation
from localkv.hub.catalog import DEFAULT_MODEL, sampling_for
from localkv.serve import metrics
from localkv.serve.openai import ApiError, Ask, bad, parse_chat, parse_completion
from localkv.serve.replies import DONE, Reply, sse
from localkv.serve.runner import STOPPING, Job, QueueFull, Runner, ShuttingDown
from localkv.toolcalls import Plan, ToolError, prepare

MAX_BODY = 16 << 20  # bytes of one request body


def model_id(model: str | None) -> str:
    """The name /v1/models lists: the catalog name, or the file's or folder's name without .gguf."""
    if model is None:
        return DEFAULT_MODEL
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


def _authorize(request: Request):
    key = request.app.state.api_key
    if not key:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, given = auth.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise ApiError(401, "missing API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key")
    if not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "incorrect API key provided", code="invalid_api_key")


def _unavailable(runner: Runner) -> ApiError | None:
    """The 503 for a server whose model is not (or never will be) in; None once it is."""
    if runner.draining:
        return _stopping()
    if runner.state == "failed":
        return ApiError(503, f"the model failed to load: {runner.error}", code="model_failed")
    if not runner.ready:
        return ApiError(503, "the model is loading; retry in a moment", code="model_loading")
    return None


def _stopping(message: str = f"{STOPPING}; retry in a moment") -> ApiError:
    return ApiError(503, message, code="server_shutting_down")


def _ready(request: Request) -> Runner:
    runner: Runner = request.app.state.runner
    if (e := _unavailable(runner)) is not None:
        raise e
    return runner


# ------------------------------------------------------------------ small routes


async def health(request: Request) -> JSONResponse:
    runner: Runner = request.app.state.runner
    e = _unavailable(runner)
    if e is None:
        return JSONResponse({"status": "ok", "model": request.app.state.model_id})
    status = "stopping" if runner.draining else runner.state
    return JSONResponse(e.body() | {"status": status}, status_code=503, headers={"Retry-After": "1"})


async def metrics_route(request: Request) -> PlainTextResponse:
    _authorize(request)
    runner: Runner = request.app.state.runner
    snap = await asyncio.wrap_future(runner.call(runner.snapshot)) if runner.ready else None
    return PlainTextResponse(metrics.render(runner.counters, snap), media_type="text/plain; version=0.0.4")


def _model_card(request: Request) -> dict:
    runner: Runner = request.app.state.runner
    return {"id": request.app.state.model_id, "object": "model", "created": int(runner.created), "owned_by": "localkv"}


async def list_models(request: Request) -> JSONResponse:
    _authorize(request)
    return JSONResponse({"object": "list", "data": [_model_card(request)]})


async def get_model(request: Request) -> JSONResponse:
    _authorize(request)
    _check_model(request, request.path_params["model"])
    return JSONResponse(_model_card(request))


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
    _authorize(request)
    return await _answer(request, parse_chat(await _body(request)))


async def completions(request: Request) -> Response:
    _authorize(request)
    return await _answer(request, parse_completion(await _body(request)))


async def _body(request: Request):
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > MAX_BODY:
        raise ApiError(413, f"the request body is {int(size)} bytes, more than {MAX_BODY}", code="request_too_large")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > MAX_BODY:
            raise ApiError(413, f"the request body is more than {MAX_BODY} bytes", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad("the request body is empty: send a JSON object")
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise bad("the request body is not UTF-8 text") from None
    except ValueError as e:
        raise bad(f"the request body is not valid JSON: {e}") from None


async def _answer(request: Request, ask: Ask) -> Response:
    runner = _ready(request)
    _check_model(request, ask.model)
    plan = prepare(ask.tools, ask.tool_choice, runner.engine.tokenizer) if ask.kind == "chat" else None
    gens = await run_in_threadpool(build, runner.engine, ask, plan)
    try:
        job = runner.submit(gens, asyncio.get_running_loop())
    except QueueFull as e:
        raise ApiError(429, str(e), code="server_busy") from None
    except ShuttingDown as e:  # the signal came while the prompt was being tokenized
        raise _stopping(str(e)) from None
    reply = Reply(ask.kind, request.app.state.model_id, runner.engine.tokenizer, ask.logprobs is not None, tools=plan)
    if ask.stream:
        return EventStream(_events(job, reply, ask), runner, job)
    try:
        await _until_done(request, job)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the job is cancelled below
    finally:
        if not job.done:
            runner.cancel(job)
    events, failed = _failure(job.take(), job)
    if failed is not None:
        raise failed
    return JSONResponse(reply.body(events))


def build(engine, ask: Ask, plan: Plan | None = None) -> list[Generation]:
    """The request's prompts as token ids and its Generations (checked against the context and
    the whole pool); `plan`: a chat's tools (toolcalls.prepare). Runs in a worker thread:
    nothing here changes the engine."""
    tok = engine.tokenizer
    values = ask.values | ({"constraint": plan.constraint} if plan and plan.constraint else {})
    try:
        if ask.kind == "chat":
            text = plan.prompt(tok, ask.messages) if plan else tok.render_chat(ask.messages)
            prompts = [tok.encode(text)]
        else:
            prompts = [
                tok.encode(p) if isinstance(p, str) else _ids(p, engine.model_config.vocab_size) for p in ask.prompts
            ]
    except ToolError as e:
        raise bad(str(e), e.param) from None
    except LocalkvError as e:  # the model's chat template refused the conversation (or failed on it)
        raise bad(str(e), "messages") from None
    try:
        params = sampling_for(engine.path, values)  # the model's catalog defaults, then the request's
        n = ask.n
        return [Generation(engine, ids, params, n=n, queued=True, first_choice=p * n) for p, ids in enumerate(prompts)]
    except ContextOverflow as e:
        raise bad(str(e), "messages" if ask.kind == "chat" else "prompt", "context_length_exceeded") from None
    except PoolExhausted as e:
        raise ApiError(413, str(e), "max_tokens", "request_too_large") from None
    except LocalkvError as e:
        raise bad(str(e)) from None


def _ids(ids: list[int], vocab: int) -> list[int]:
    if any(not 0 <= t < vocab for t in ids):
        raise bad(f"invalid 'prompt': token ids must be in 0..{vocab - 1}", "prompt")
    return ids


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _until_done(request: Request, job: Job):
    """Wait for the job; a client that disconnects first cancels it."""

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        while not job.done:
            waiter = asyncio.ensure_future(job.wake.wait())
            finished, _ = await asyncio.wait({watcher, waiter}, return_when=asyncio.FIRST_COMPLETED)
            job.wake.clear()
            if watcher in finished:
                waiter.cancel()
                raise ClientGone()
    finally:
        watcher.cancel()


def _failure(events: list[Event], job: Job) -> tuple[list[Event], ApiError | None]:
    """The events before a Failed one, and the error it means: a 500 when a step broke, a 503
    when the server stopped (None when the job did not fail)."""
    for i, ev in enumerate(events):
        if isinstance(ev, Failed):
            return events[:i], _stopping(ev.message) if job.stopped else ApiError(500, ev.message, code="server_error")
    return events, None


async def _events(job: Job, reply: Reply, ask: Ask):
    """The SSE stream: a role chunk per choice (chat), text as it comes, each choice's finish
    reason, the usage if asked, [DONE]. A step that failed ends it with an error event."""
    if ask.kind == "chat":
        yield reply.roles(len(job.gens) * ask.n)
    async for batch in job.batches():
        events, failed = _failure(batch, job)
        text = reply.stream(events)
        if failed is not None:
            yield text + sse(failed.body()) + DONE
            return
        if text:
            yield text
    yield reply.end(ask.include_usage)


class EventStream(StreamingResponse):
    """Server-sent events that end, and cancel their job, as soon as the client disconnects
    (also while the request still waits for a seat and nothing is being sent)."""

    media_type = "text/event-stream"

    def __init__(self, content, runner: Runner, job: Job):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.runner, self.job = runner, job

    async def __call__(self, scope, receive, send):
        try:
            async with anyio.create_task_group() as tg:

                async def stream():
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            if not self.job.done:
                self.runner.cancel(self.job)
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
