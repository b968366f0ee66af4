"""`localkv run` and `localkv fork`: one reply, or N replies sharing the prompt's KV blocks."""

import sys
from dataclasses import replace
from pathlib import Path

import typer

import localkv.cli.render as render
from localkv.cli.app import err, read_prompt, warn_disk
from localkv.cli.options import Sampling, engine_options, sampling_options
from localkv.cli.prefill_bar import PrefillBar
from localkv.config import EngineConfig
from localkv.conversations.turn import Turn, plan_turn
from localkv.errors import LocalkvError

SystemOpt = typer.Option(None, "-s", "--system", help="System prompt (new conversations).")
SaveOpt = typer.Option(False, "--no-save", help="Do not save this exchange in the conversation log.")
ContinueOpt = typer.Option(False, "-c", "--continue", help="Continue the latest conversation.")
CidOpt = typer.Option(None, "--cid", help="Continue the conversation with this id (see `localkv log`).")
ToolsOpt = typer.Option(None, "--tools", help="OpenAI-style tools (a JSON file): the calls print as JSON lines.")
ToolChoiceOpt = typer.Option(None, "--tool-choice", help="auto (default), required, none, or a function's name.")


HideOpt = typer.Option(False, "--hide-thinking", help="Do not print a thinking model's thinking (stderr).")


def _prompt_ids(engine, turn: Turn, text: str | None, raw: bool, params, plan=None):
    """The prompt's token ids and, for a thinking model's chat reply, its reasoning.Plan."""
    from localkv import reasoning

    tok = engine.tokenizer
    if raw:
        return tok.encode("\n".join([m["content"] for m in turn.messages(None)] + ([text] if text else []))), None
    prompt, thinking = reasoning.chat(tok, turn.messages(text), params, tools=plan)
    return tok.encode(prompt), thinking


class ThinkingOut:
    """A thinking model's thinking on stderr as it streams, dimmed on a terminal, a line break
    before the answer; nothing with --hide-thinking."""

    def __init__(self, hide: bool):
        self.hide, self.dim = hide, sys.stderr.isatty()
        self.open = False  # thinking was printed and its line not ended yet

    def write(self, text: str) -> None:
        if self.hide or not text:
            return
        if not self.open and self.dim:
            sys.stderr.write("\x1b[2m")
        self.open = True
        sys.stderr.write(text)
        sys.stderr.flush()

    def end(self) -> None:
        if self.open:
            sys.stderr.write(("\x1b[0m" if self.dim else "") + "\n")
            sys.stderr.flush()
            self.open = False


def _start(engine_cfg: EngineConfig):
    from localkv.engine import Engine

    return Engine(engine_cfg, progress=sys.stderr.isatty())


@engine_options()
@sampling_options(output=True)
def run(
    prompt: str | None = typer.Argument(None, help="The prompt. Text piped on stdin is put before it."),
    system: str | None = SystemOpt,
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is, without the chat template."),
    no_stream: bool = typer.Option(False, "--no-stream", help="Print the reply only when it is complete."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with text, counts, timings, KV use."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Timings and KV use on stderr."),
    cont: bool = ContinueOpt,
    cid: str | None = CidOpt,
    no_save: bool = SaveOpt,
    tools_file: Path | None = ToolsOpt,
    tool_choice: str | None = ToolChoiceOpt,
    hide_thinking: bool = HideOpt,
    *,
    engine: EngineConfig,
    sampling: Sampling,
):
    """Generate a reply to PROMPT and stream it to stdout (a thinking model's thinking to stderr); the
    exchange is saved in the conversation log."""
    from localkv.generation import Generation

    tools = _tools(tools_file, tool_choice, raw, sampling)
    text = read_prompt(prompt)
    turn = plan_turn(not no_save, cont, cid, None, system, text)
    eng = _start(engine)
    params = sampling.resolve(eng.path)
    plan = None
    if tools is not None:
        from localkv.toolcalls import prepare

        plan = prepare(*tools, eng.tokenizer)
        params = replace(params, constraint=plan.constraint)
    bar = PrefillBar()
    ids, thinking = _prompt_ids(eng, turn, text, raw, params, plan)
    gen = Generation(eng, ids, params, on_progress=bar, reasoning=thinking)
    stream = not (no_stream or as_json or plan)
    out = ThinkingOut(hide_thinking or as_json)
    r = _drain(gen, bar, stream, out)
    if not stream:
        out.write(r.reasoning)
        out.end()
    reply = [(r.text, r.completion_tokens, r.reasoning)]
    _, reply_ids = turn.save(eng.model_config.name, text, reply, r.prompt_tokens, params)
    saved = render.Saved.of(turn, reply_ids)
    if as_json:
        print(render.dumps(render.reply_json(eng, r, saved, logprobs=params.logprobs is not None)))
    elif plan is not None:
        from localkv.cli.tools import print_calls  # the tool-call parts load only for --tools

        print_calls(plan, r.text)
    else:
        sys.stdout.write(("" if stream else r.text) + "\n")
        sys.stdout.flush()
    warn_disk(eng)
    if r.finish_reason == "kv_budget" and not as_json:
        err(f"stopped: {r.stop_detail}")
    if verbose:
        err(render.reply_verbose(eng, r, saved))
    if r.finish_reason == "interrupted":
        raise typer.Exit(130)


def _tools(path: Path | None, choice: str | None, raw: bool, sampling: Sampling):
    """--tools and --tool-choice, checked before any model loads."""
    if path is None:
        if choice is not None:
            raise LocalkvError("--tool-choice needs --tools FILE")
        return None
    if raw:
        raise LocalkvError("--tools needs the chat template: it does not go with --raw")
    if "constraint" in sampling.values:
        raise LocalkvError("--tools and --format/--schema/--grammar do not go together: the calls have their grammar")
    from localkv.cli.tools import load

    return load(path, choice)


def _drain(gen, bar: PrefillBar, stream: bool, thinking: ThinkingOut):
    """Run gen to its end, its text to stdout (its thinking to `thinking`) as it comes when
    stream, and return its result. Ctrl-C ends it early and keeps what was generated (the
    result says "interrupted")."""
    try:
        for piece in gen:
            if stream:
                thinking.write(piece.reasoning)
                if piece.text:
                    thinking.end()
                    sys.stdout.write(piece.text)
                    sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    finally:
        bar.close()
        if stream:
            thinking.end()
    return gen.result


@engine_options()
@sampling_options(defaults={"max_tokens": 256}, output=True)
def fork(
    prompt: str | None = typer.Argument(
        None,
        help="The prompt. Text piped on stdin is put before it. Optional with --from: re-sample that message's reply.",
    ),
    branches: int = typer.Option(4, "-b", "--branches", help="How many alternative replies to sample."),
    from_msg: str | None = typer.Option(
        None, "--from", help="Branch at this earlier message (see `localkv log ID --tree`)."
    ),
    cont: bool = ContinueOpt,
    cid: str | None = CidOpt,
    system: str | None = SystemOpt,
    as_json: bool = typer.Option(False, "--json", help="One JSON object: branches and KV use."),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Timings on stderr."),
    no_save: bool = SaveOpt,
    *,
    engine: EngineConfig,
    sampling: Sampling,
):
    """Sample N alternative replies that share the prompt's KV blocks (best-of-N), decoded as one batch,
    and save them as sibling branches. All branches must fit the KV pool at once; the command says so
    before any work when they do not."""
    from localkv.generation import Generation

    if branches < 1:
        raise LocalkvError(f"invalid --branches {branches}: must be >= 1")
    text = read_prompt(prompt, required=not from_msg)
    turn = plan_turn(not no_save, cont, cid, from_msg, system, text)
    eng = _start(engine)
    params = sampling.resolve(eng.path)
    bar = PrefillBar()
    ids, thinking = _prompt_ids(eng, turn, text, False, params)
    try:
        res = Generation(eng, ids, params, n=branches, on_progress=bar, reasoning=thinking).run()
    finally:
        bar.close()
    replies = [(b.text, len(b.tokens), b.reasoning) for b in res.branches]
    _, reply_ids = turn.save(eng.model_config.name, text, replies, res.prompt_tokens, params)
    saved = render.Saved.of(turn, reply_ids)
    if as_json:
        print(render.dumps(render.fork_json(eng, res, saved, logprobs=params.logprobs is not None)))
    else:
        print(render.fork_text(eng, res, saved))
    warn_disk(eng)
    if verbose:
        err(render.fork_verbose(eng, res, saved))
