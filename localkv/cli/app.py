"""The Typer application every `localkv` command registers on, and the helpers they share."""

import sys

import typer

from localkv.errors import LocalkvError

app = typer.Typer(
    help="Local LLM inference over a paged KV cache.\n\n"
    "Models are kept under LOCALKV_HOME (default ~/.cache/localkv); the default model, "
    "SmolLM2-135M-Instruct, is pulled on first use.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def err(msg: str):
    print(msg, file=sys.stderr)


def read_prompt(prompt: str | None, required: bool = True) -> str | None:
    """stdin (when piped) comes first, then the PROMPT argument, as `llm` and `ollama` do."""
    parts = []
    if not sys.stdin.isatty():
        data = sys.stdin.read()
        if data.strip():
            parts.append(data.rstrip("\n"))
    if prompt:
        parts.append(prompt)
    text = "\n".join(parts)
    if not text.strip():
        if not required:
            return None
        raise LocalkvError("empty prompt: pass PROMPT or pipe text on stdin")
    return text


def warn_disk(engine):
    if engine.disk is not None and engine.disk.warning:
        err(f"warning: {engine.disk.warning}")
