"""One request's trip through the runner, whichever API it came in by (OpenAI's, Ollama's): its
body read as JSON, the key checked, its Ask turned into Generations off the event loop (tokenizing
a long prompt takes a while), the Job submitted, waited on or streamed, and the error a failed
job means. The routes render the Job's events in their API's shape; none reads a Generation."""

import asyncio
import hmac
import json
from collections.abc import Callable
from dataclasses import replace

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import StreamingResponse

from localkv import next_turn, reasoning
from localkv.errors import ContextOverflow, LocalkvError, PoolExhausted
from localkv.events import Event, Failed
from localkv.generation import Generation
from localkv.hub.catalog import sampling_for
from localkv.serve.openai import ApiError, Ask, bad
from localkv.serve.runner import STOPPING, Job, QueueFull, Runner, ShuttingDown
from localkv.toolcalls import Plan, ToolError, prepare

MAX_BODY = 16 << 20  # bytes of one request body


async def read_json(request: Request):
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


def authorize(request: Request):
    key = request.app.state.api_key
    if not key:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, given = auth.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise ApiError(401, "missing API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key")
    if not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "incorrect API key provided", code="invalid_api_key")


def unavailable(runner: Runner) -> ApiError | None:
    """The 503 for a server whose model is not (or never will be) in; None once it is."""
    if runner.draining:
        return stopping()
    if runner.state == "failed":
        return ApiError(503, f"the model failed to load: {runner.error}", code="model_failed")
    if not runner.ready:
        return ApiError(503, "the model is loading; retry in a moment", code="model_loading")
    return None


def stopping(message: str = f"{STOPPING}; retry in a moment") -> ApiError:
    return ApiError(503, message, code="server_shutting_down")


def ready(request: Request) -> Runner:
    runner: Runner = request.app.state.runner
    if (e := unavailable(runner)) is not None:
        raise e
    return runner


def tool_plan(ask: Ask, tok) -> Plan | None:
    """A chat's tools as toolcalls prepares them, whichever API asked (None for completions)."""
    return prepare(ask.tools, ask.tool_choice, tok) if ask.kind == "chat" else None


async def submit(runner: Runner, ask: Ask, plan: Plan | None = None) -> Job:
    """The Ask's Generations, queued on the runner (429 when it is full, 503 when it stops);
    `plan`: a chat's tools (toolcalls.prepare)."""
    gens = await run_in_threadpool(build, runner.engine, ask, plan, runner.opts.defaults)
    try:
        return runner.submit(gens, asyncio.get_running_loop(), _next_prefix(runner.engine, ask, plan, gens))
    except QueueFull as e:
        raise ApiError(429, str(e), code="server_busy") from None
    except ShuttingDown as e:  # the signal came while the prompt was being tokenized
        raise stopping(str(e)) from None


def _next_prefix(engine, ask: Ask, plan: Plan | None, gens: list[Generation]) -> Callable[[], list[int]] | None:
    """For a chat with one reply: the next turn's prefix once the reply is known, to warm while
    idle (next_turn.py). A client that asked for several replies may send back any."""
    if ask.kind != "chat" or len(gens) != 1 or gens[0].n != 1:
        return None
    g, tok = gens[0], engine.tokenizer
    return lambda: next_turn.prefix_ids(tok, ask.messages, g.result.text, g.params, ask.template_vars, plan)


def build(engine, ask: Ask, plan: Plan | None = None, defaults: dict | None = None) -> list[Generation]:
    """The request's prompts as token ids and its Generations (checked against the context and
    the whole pool); `plan`: a chat's tools; `defaults`: the server's sampling for what the
    request does not set. Runs in a worker thread: nothing here changes the engine."""
    params, prompts, thinking = render(engine, ask, plan, defaults)
    try:
        n, each = ask.n, [_within(params, ask, len(ids), engine.ctx) for ids in prompts]
        return [
            Generation(engine, ids, pp, n=n, queued=True, first_choice=p * n, reasoning=thinking)
            for p, (ids, pp) in enumerate(zip(prompts, each))
        ]
    except ContextOverflow as e:
        raise bad(str(e), "messages" if ask.kind == "chat" else "prompt", "context_length_exceeded") from None
    except PoolExhausted as e:
        raise ApiError(413, str(e), "max_tokens", "request_too_large") from None
    except LocalkvError as e:
        raise bad(str(e)) from None


def render(engine, ask: Ask, plan: Plan | None = None, defaults: dict | None = None):
    """The request's sampling, the token ids of each of its prompts, and a chat reply's thinking
    (a thinking model's): what build() runs, and what /v1/*/render show a router."""
    values = {k: v for k, v in ask.values.items() if v is not None}
    values = (defaults or {}) | values | ({"constraint": plan.constraint} if plan and plan.constraint else {})
    try:
        params = sampling_for(engine.path, values)  # the catalog's defaults, the server's, then the request's
    except LocalkvError as e:
        raise bad(str(e)) from None
    return (params, *_prompts(engine, ask, plan, params))


def _prompts(engine, ask: Ask, plan: Plan | None, params) -> tuple[list[list[int]], reasoning.Plan | None]:
    """The token ids of each prompt, and a chat reply's thinking (a thinking model's)."""
    tok = engine.tokenizer
    if ask.thinking_asked and reasoning.family(tok.chat_template) is None:
        raise bad(f'"{ask.model}" does not support thinking', "think")
    try:
        if ask.kind == "chat":
            text, thinking = reasoning.chat(tok, ask.messages, params, tools=plan, extra=ask.template_vars)
            return [tok.encode(text)], thinking
        vocab = engine.model_config.vocab_size
        return [tok.encode(p) if isinstance(p, str) else _ids(p, vocab) for p in ask.prompts], None
    except ToolError as e:
        raise bad(str(e), e.param) from None
    except LocalkvError as e:  # the model's chat template refused the conversation (or failed on it)
        raise bad(str(e), "messages") from None


def _within(params, ask: Ask, n_prompt: int, ctx: int):
    """params with the reply cut to the request's own context window (Ollama's num_ctx): the
    prompt and the reply within it, the engine's context at most; without max_tokens the reply
    may run to its end."""
    if ask.window is None:
        return params
    window = min(ask.window, ctx) if ask.window else ctx
    room = window - n_prompt
    if room < 1:
        raise ContextOverflow(f"prompt is {n_prompt} tokens; the request's context (num_ctx) holds {window}")
    given = ask.values.get("max_tokens")
    return replace(params, max_tokens=min(given, room) if given else room)


def _ids(ids: list[int], vocab: int) -> list[int]:
    if any(not 0 <= t < vocab for t in ids):
        raise bad(f"invalid 'prompt': token ids must be in 0..{vocab - 1}", "prompt")
    return ids


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def until_done(request: Request, job: Job):
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


async def whole(request: Request, runner: Runner, job: Job) -> list[Event] | None:
    """Every event of a job that succeeded (None: the client left first, and the job is
    cancelled); the job's failure raised as its ApiError."""
    try:
        await until_done(request, job)
    except ClientGone:
        return None
    finally:
        if not job.done:
            runner.cancel(job)
    events, failed = failure(job.take(), job)
    if failed is not None:
        raise failed
    return events


def failure(events: list[Event], job: Job) -> tuple[list[Event], ApiError | None]:
    """The events before a Failed one, and the error it means: a 500 when a step broke, a 503
    when the server stopped (None when the job did not fail)."""
    for i, ev in enumerate(events):
        if isinstance(ev, Failed):
            return events[:i], stopping(ev.message) if job.stopped else ApiError(500, ev.message, code="server_error")
    return events, None


class EventStream(StreamingResponse):
    """A streamed answer (server-sent events; Ollama's NDJSON) that ends, and cancels its job, as
    soon as the client disconnects (also while the request still waits for a seat and nothing is
    being sent)."""

    def __init__(self, content, runner: Runner, job: Job, media_type: str = "text/event-stream"):
        super().__init__(
            content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, media_type=media_type
        )
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
