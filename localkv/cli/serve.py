"""`localkv serve`: OpenAI's HTTP API on a local port, many requests batched over one KV pool."""

import os

import typer

from localkv.cli.app import err
from localkv.cli.options import engine_options
from localkv.config import PREFILL_CHUNK, EngineConfig, ServeOptions

D = ServeOptions()  # the flags' defaults


@engine_options()
def serve(
    host: str = typer.Option(D.host, "--host", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(D.port, "--port", help="TCP port (0: any free one)."),
    max_seqs: int = typer.Option(D.max_seqs, "--max-seqs", help="Most sequences decoded at once (n choices count n)."),
    max_queue: int = typer.Option(
        D.max_queue, "--max-queue", help="Requests that may wait beyond --max-seqs; past it the server answers 429."
    ),
    batch_tokens: int = typer.Option(
        D.batch_tokens,
        "--batch-tokens",
        help="Most tokens one step runs over all requests (prompt chunks and decodes); one prompt "
        f"advances at most {PREFILL_CHUNK} a step. More: new prompts are computed "
        "together, running streams pause longer while they are.",
    ),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        help="Require 'Authorization: Bearer KEY' (else 401). Default: $LOCALKV_API_KEY, or no key.",
        show_default=False,
    ),
    log_requests: bool = typer.Option(D.log_requests, "--log-requests", help="Log each HTTP request on stderr."),
    think: bool | None = typer.Option(
        None,
        "--think/--no-think",
        help="Whether a thinking model thinks, for requests that do not say (OpenAI's reasoning_effort and "
        "chat_template_kwargs, Ollama's think). [default: the model's catalog default, else think]",
        show_default=False,
    ),
    reasoning_budget: int | None = typer.Option(
        None,
        "--reasoning-budget",
        help="Most tokens a thinking model thinks, for requests that do not say; then its closing tag is "
        "forced. 0 = --no-think. [default: the model's catalog default, else -1, no limit]",
        show_default=False,
    ),
    shutdown_timeout: float = typer.Option(
        D.shutdown_timeout,
        "--shutdown-timeout",
        help="On SIGTERM or Ctrl-C, seconds the requests in flight may take to finish; then each "
        "ends with an error. New requests get 503 meanwhile; a second signal stops at once.",
    ),
    kv_events: str | None = typer.Option(
        None,
        "--kv-events",
        help="Publish the prefix cache's block stores and removals (memory and disk) at this ZeroMQ "
        "endpoint, in vLLM's KV event format, for KV-aware routers (e.g. tcp://*:5557).",
        show_default=False,
    ),
    kv_events_replay: str | None = typer.Option(
        None,
        "--kv-events-replay",
        help="A ZeroMQ endpoint that resends recent event batches from a sequence number on request "
        "(vLLM's replay socket, e.g. tcp://*:5558).",
        show_default=False,
    ),
    kv_events_topic: str = typer.Option(D.kv_events_topic, "--kv-events-topic", help="The events' topic frame."),
    *,
    engine: EngineConfig,
):
    """Serve the model over OpenAI's HTTP API (/v1/chat/completions, /v1/completions, /v1/models),
    with /health and Prometheus /metrics. Requests share one KV block pool: they are batched step
    by step (continuous batching), a common prompt prefix is computed once, and n choices are
    forks of one prompt. The model loads after the port is open (/health answers 503 until then)."""
    from localkv.serve.server import serve as run_server  # uvicorn and starlette load only here

    key = api_key if api_key is not None else os.environ.get("LOCALKV_API_KEY") or None
    given = {"think": think, "reasoning_budget": reasoning_budget}
    opts = ServeOptions(
        host,
        port,
        max_seqs,
        max_queue,
        batch_tokens,
        key,
        log_requests,
        shutdown_timeout=shutdown_timeout,
        kv_events=kv_events,
        kv_events_replay=kv_events_replay,
        kv_events_topic=kv_events_topic,
        defaults={k: v for k, v in given.items() if v is not None},
    )
    run_server(engine, opts, say=err)
