"""`localkv chat`: the options and checks before the UI starts (register with app.command("chat"))."""

import sys
from typing import Optional

import typer

from localkv.cli import (BlockSizeOpt, BudgetOpt, CacheOpt, CidOpt, ContinueOpt, EvictOpt, KvMemOpt, ModelOpt,
                         _engine, _sampling)
from localkv.errors import LocalkvError


def chat_command(
    model: Optional[str] = ModelOpt,
    system: Optional[str] = typer.Option(None, "-s", "--system", help="System prompt (new conversations)."),
    cont: bool = ContinueOpt,
    cid: Optional[str] = CidOpt,
    temperature: float = typer.Option(0.8, "-t", "--temperature", help="Sampling temperature; 0 = greedy."),
    top_k: int = typer.Option(40, "--top-k", help="Sample from the k most likely tokens; 0 = all."),
    top_p: float = typer.Option(0.95, "--top-p", help="Nucleus sampling threshold, in (0, 1]."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed: the same seed gives the same text."),
    max_tokens: int = typer.Option(512, "-n", "--max-tokens", help="Most tokens per reply."),
    kv_budget: Optional[int] = BudgetOpt,
    evict: str = EvictOpt,
    block_size: int = BlockSizeOpt,
    kv_mem: str = KvMemOpt,
    no_cache: bool = CacheOpt,
):
    """Chat in a full-screen terminal UI: streaming replies, slash commands (/help), the
    conversation tree (fork at any message, regenerate, switch branches) and a live KV-cache
    panel. Every exchange is saved in the conversation log, as `localkv run` saves it."""
    from localkv.conversation import plan_turn
    from localkv.engine import Engine

    from .app import ChatApp

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise LocalkvError("`localkv chat` needs a terminal; use `localkv run` with pipes")
    params = _sampling(temperature, top_k, top_p, seed, max_tokens)
    turn = plan_turn(True, cont, cid, None, system, "")  # unknown ids fail here, before the model loads
    # the default model is pulled here, with its progress bar on stderr, before the UI takes the screen
    engine = _engine(model, block_size, kv_mem, None, no_cache, "2GiB", kv_budget, evict)

    def factory(policy):  # /set evict|budget: the same engine with another KV policy
        return Engine(engine.path, block_size=block_size, kv_mem=kv_mem, progress=False,
                      prefix_caching=not no_cache, evict=policy)

    app = ChatApp(engine, turn.store, conversation=turn.conversation_id, leaf=turn.parent_id, system=system,
                  sampling=params, max_tokens=max_tokens, factory=factory)
    app.run()
    if app.cid is not None:
        print(f"conversation {turn.store.short_id(app.cid)} (`localkv chat --cid "
              f"{turn.store.short_id(app.cid)}` continues it)", file=sys.stderr)
    if app.return_code:
        raise typer.Exit(app.return_code)
