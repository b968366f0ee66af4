"""`localkv chat`: the options and checks before the UI starts (register with app.command("chat"))."""

import sys

import typer

from localkv.errors import LocalkvError

# Options as `localkv run` spells them. Defined here, not imported from localkv.cli: that module
# imports this one while it registers its commands, so importing it back here would be circular.
ModelOpt = typer.Option(
    None,
    "-m",
    "--model",
    help="Catalog name (see `localkv models`), a .gguf file, or a Hugging Face style "
    "directory (config.json + *.safetensors + tokenizer.json). Default: smollm2-135m.",
)
BudgetOpt = typer.Option(None, "--kv-budget", help="Most tokens of KV one sequence may hold; past it --evict decides.")
EvictOpt = typer.Option(
    "none",
    "--evict",
    help="When the budget is full: none (stop), sliding (attention sinks + "
    "recent window), h2o (half the window, + each layer-head's "
    "heaviest tokens), offload (move blocks to "
    "host memory and recall them when the query needs them). "
    "/set evict|budget change it in the chat.",
)


def chat_command(
    model: str | None = ModelOpt,
    system: str | None = typer.Option(None, "-s", "--system", help="System prompt (new conversations)."),
    cont: bool = typer.Option(False, "-c", "--continue", help="Continue the latest conversation."),
    cid: str | None = typer.Option(None, "--cid", help="Continue the conversation with this id (see `localkv log`)."),
    temperature: float = typer.Option(0.8, "-t", "--temperature", help="Sampling temperature; 0 = greedy."),
    top_k: int = typer.Option(40, "--top-k", help="Sample from the k most likely tokens; 0 = all."),
    top_p: float = typer.Option(0.95, "--top-p", help="Nucleus sampling threshold, in (0, 1]."),
    seed: int | None = typer.Option(None, "--seed", help="Random seed: the same seed gives the same text."),
    max_tokens: int = typer.Option(512, "-n", "--max-tokens", help="Most tokens per reply."),
    kv_budget: int | None = BudgetOpt,
    evict: str = EvictOpt,
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block."),
    kv_mem: str = typer.Option("1GiB", "--kv-mem", help="Memory for the KV block pool, e.g. 512MiB or 2GiB."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Disable the prefix cache (memory and disk tiers)."),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when CuPy sees a GPU, else CPU), cpu or cuda."),
):
    """Chat in a full-screen terminal UI: streaming replies, slash commands (/help), the
    conversation tree (fork at any message, regenerate, switch branches) and a live KV-cache
    panel. Every exchange is saved in the conversation log, as `localkv run` saves it."""
    from localkv.cli import _engine, _sampling
    from localkv.conversations.turn import plan_turn
    from localkv.engine import Engine
    from localkv.tui.app import ChatApp

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise LocalkvError("`localkv chat` needs a terminal; use `localkv run` with pipes")
    params = _sampling(temperature, top_k, top_p, seed, max_tokens)
    turn = plan_turn(True, cont, cid, None, system, "")  # unknown ids fail here, before the model loads
    # the default model is pulled here, with its progress bar on stderr, before the UI takes the screen
    engine = _engine(model, block_size, kv_mem, None, no_cache, "2GiB", kv_budget=kv_budget, evict=evict, device=device)

    def factory(policy):  # /set evict|budget: the same engine with another KV policy
        return Engine(
            engine.path,
            block_size=block_size,
            kv_mem=kv_mem,
            progress=False,
            prefix_caching=not no_cache,
            evict=policy,
            device=device,
        )

    app = ChatApp(
        engine,
        turn.store,
        conversation=turn.conversation_id,
        leaf=turn.parent_id,
        system=system,
        sampling=params,
        max_tokens=max_tokens,
        factory=factory,
    )
    app.run()
    if app.cid is not None:
        print(
            f"conversation {turn.store.short_id(app.cid)} (`localkv chat --cid "
            f"{turn.store.short_id(app.cid)}` continues it)",
            file=sys.stderr,
        )
    if app.return_code:
        raise typer.Exit(app.return_code)
