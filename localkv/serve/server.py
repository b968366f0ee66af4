"""Running the app: a listening socket (bound before uvicorn starts, so a port in use is one
clear error), uvicorn in the foreground for `localkv serve`, or in a background thread for tests
and the bench. The model loads after the socket listens.

A stop (SIGTERM or SIGINT) drains: the socket stays open so a new request gets a 503 with
Retry-After rather than a refused connection, the requests in flight finish (or, past
--shutdown-timeout, end with an error event), then uvicorn closes the connections and the
lifespan joins the engine's thread, whose disk writes are then complete: exit 0. uvicorn's own
handling would wait 3 s, cut the streams, and re-raise the signal (death by SIGTERM)."""

import contextlib
import ipaddress
import os
import socket
import sys
import threading

import uvicorn

from localkv.config import EngineConfig, ServeOptions
from localkv.errors import LocalkvError
from localkv.serve.app import create_app
from localkv.serve.runner import Runner


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: any free one, checked by ServeOptions.validate);
    LocalkvError when it cannot be."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        raise LocalkvError(f"cannot listen on {host!r}: {e.strerror} (check --host)") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise LocalkvError(f"cannot listen on {host}:{port}: {e.strerror or e} (choose another --port)") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Server(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains the runner before the server exits; a second
    one exits at once (its disk writes may be cut: a temp file the next start sweeps)."""

    def __init__(self, config: uvicorn.Config, runner: Runner, say=print):
        super().__init__(config)
        self.runner, self.say = runner, say
        self.stop_signal = 0  # set by the handler, acted on by on_tick (a handler may not take locks)

    def handle_exit(self, sig: int, frame) -> None:  # never records sig: uvicorn would re-raise it
        if self.stop_signal:
            os.write(2, b"localkv serve: stopped at once by a second signal\n")
            os._exit(128 + sig)
        self.stop_signal = sig

    async def on_tick(self, counter: int) -> bool:
        runner = self.runner
        if self.stop_signal and not runner.draining:
            runner.drain()
            self.say(
                f"localkv serve: stopping: {runner.in_flight} requests in flight get up to "
                f"{runner.opts.shutdown_timeout:g}s to finish (a second signal stops at once)"
            )
        if runner.draining and not runner.in_flight:
            self.should_exit = True
        return await super().on_tick(counter)


def _uvicorn(app, opts: ServeOptions, runner: Runner, say=print) -> _Server:
    config = uvicorn.Config(
        app,
        log_level="info" if opts.log_requests else "warning",
        access_log=opts.log_requests,
        timeout_graceful_shutdown=3,  # after the drain: the last bytes of the answers already ended
        lifespan="on",
    )
    return _Server(config, runner, say)


def serve(engine: EngineConfig, opts: ServeOptions, say=print) -> None:
    """Serve until Ctrl-C (or SIGTERM). Bad options, or a model that fails to load, stop the
    server: LocalkvError."""
    opts.validate()
    sock = listen(opts.host, opts.port)
    runner = Runner(engine, opts)
    server = _uvicorn(create_app(runner, opts.api_key), opts, runner, say)
    url = url_of(sock)

    def on_state(state: str):
        if state == "failed":
            server.should_exit = True
            return
        e = runner.engine
        say(
            f"localkv serve: {e.model_config.name} ready in {runner.load_s:.1f}s; KV pool {e.pool.num_blocks} "
            f"blocks of {e.block_size} tokens; up to {opts.max_seqs} sequences at once"
        )

    runner.on_state = on_state
    if not is_loopback(opts.host) and not opts.api_key:
        say(f"localkv serve: warning: listening on {opts.host} without --api-key: anyone who reaches it can use it")
    apis = f"OpenAI API at {url}/v1, Ollama's at {url}/api; /health, /metrics"
    say(f"localkv serve: listening on {url} ({apis}); loading the model...")
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # a Ctrl-C before uvicorn took the signals: nothing was running yet
        pass
    finally:
        sock.close()
    if runner.state == "failed":
        raise LocalkvError(runner.error)
    say("localkv serve: stopped")


class BackgroundServer:
    """The server in a thread on a free loopback port (tests, the bench): `with BackgroundServer(
    config) as s:` waits for the model, then s.url and s.runner (its engine, for pool checks)."""

    def __init__(
        self, engine: EngineConfig, opts: ServeOptions | None = None, wait: bool = True, runner: type = Runner
    ):
        self.opts = (opts or ServeOptions(port=0)).validate()
        self.sock = listen(self.opts.host, self.opts.port)
        self.url = url_of(self.sock)
        self.runner = runner(engine, self.opts)
        self._ready = threading.Event()
        self.runner.on_state = lambda state: self._ready.set()
        self.server = _uvicorn(create_app(self.runner, self.opts.api_key), self.opts, self.runner)
        self._thread = threading.Thread(target=self._run, name="localkv-http", daemon=True)
        self._wait = wait

    def _run(self):
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as e:  # shown, not lost in a thread
            print(f"localkv serve: the HTTP thread stopped: {type(e).__name__}: {e}", file=sys.stderr)

    def __enter__(self) -> "BackgroundServer":
        self._thread.start()
        if self._wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 300.0):
        if not self._ready.wait(timeout) or self.runner.state != "ready":
            self.stop()
            raise LocalkvError(f"the server did not start: {self.runner.error or 'timed out loading the model'}")

    def stop(self):
        self.server.should_exit = True
        self._thread.join(30)
        self.runner.close()
        with contextlib.suppress(OSError):
            self.sock.close()

    def __exit__(self, *exc):
        self.stop()
