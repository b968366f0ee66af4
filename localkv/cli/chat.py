"""`localkv chat`: the options and checks before the full-screen chat (tui/) takes the terminal."""

import sys

import typer

from localkv.cli.app import err
from localkv.cli.options import Sampling, engine_options, sampling_options
from localkv.config import EngineConfig
from localkv.conversations.turn import plan_turn
from localkv.errors import LocalkvError


@engine_options()
@sampling_options()
def chat(
    system: str | None = typer.Option(None, "-s", "--system", help="System prompt (new conversations)."),
    cont: bool = typer.Option(False, "-c", "--continue", help="Continue the latest conversation."),
    cid: str | None = typer.Option(None, "--cid", help="Continue the conversation with this id (see `localkv log`)."),
    *,
    engine: EngineConfig,
    sampling: Sampling,
):
    """Chat in a full-screen terminal UI: streaming replies, slash commands (/help), the
    conversation tree (fork at any message, regenerate, switch branches) and a live KV-cache
    panel. Every exchange is saved in the conversation log, as `localkv run` saves it.
    /set changes sampling (temperature, min_p, repeat_penalty, stop, ...) and the KV policy in the chat."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise LocalkvError("`localkv chat` needs a terminal; use `localkv run` with pipes")
    from localkv.engine import Engine
    from localkv.tui.app import ChatApp

    turn = plan_turn(True, cont, cid, None, system, "")  # unknown ids fail here, before the model loads
    # the default model is pulled here, with its progress bar on stderr, before the UI takes the screen
    eng = Engine(engine, progress=sys.stderr.isatty())
    params = sampling.resolve(eng.path)  # the model's catalog defaults under the flags given
    ui = ChatApp(
        eng, turn.store, conversation=turn.conversation_id, leaf=turn.parent_id, system=system, sampling=params
    )
    ui.run()
    if ui.cid is not None:
        short = turn.store.short_id(ui.cid)
        err(f"conversation {short} (`localkv chat --cid {short}` continues it)")
    if ui.return_code:
        raise typer.Exit(ui.return_code)
