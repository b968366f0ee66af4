"""The Typer application every `localkv` command registers on, and the helpers they share:
reading the prompt, repairing text that is not UTF-8, and standard streams that fail."""

import contextlib
import io
import os
import re
import sys

import typer

from localkv.errors import LocalkvError

app = typer.Typer(
    help="Local LLM inference over a paged KV cache.\n\n"
    "Models are kept under LOCALKV_HOME (default ~/.cache/localkv); the default model, "
    "SmolLM2-135M-Instruct, is pulled on first use.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, PowerShell
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool):
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"localkv {version('localkv')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            print("localkv (not installed)")
        raise typer.Exit()


@app.callback()
def _main_options(
    show_version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
):
    pass


REPLACED = "undecodable bytes were replaced with U+FFFD"
_SURROGATE = re.compile("[\ud800-\udfff]")


def err(msg: str):
    print(msg, file=sys.stderr)


def utf8_text(s: str) -> str:
    """s with the bytes that were not UTF-8 (which Python hands over as lone surrogates, from
    argv or a surrogateescape stream) replaced by U+FFFD: the tokenizer and the conversation log
    take only real text, and a model reads a few U+FFFD better than nothing."""
    try:
        return s.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # surrogates that are not escaped bytes
        return _SURROGATE.sub("\ufffd", s)


def shown(s: str) -> str:
    """An argument as the user typed it, quoted, its undecodable bytes as \\xNN."""
    try:
        b = s.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        b = s.encode("utf-8", "surrogatepass")
    return "'" + b.decode("utf-8", "backslashreplace") + "'"


def utf8_argv(args: list[str]) -> list[str]:
    """Arguments with their undecodable bytes replaced (one warning for all), except those that
    name an existing file: a POSIX file name may hold any bytes and must reach open() as is."""
    out, bad = [], []
    for a in args:
        value = a.partition("=")[2] if a.startswith("--") and "=" in a else a
        if not _SURROGATE.search(a) or os.path.lexists(value):
            out.append(a)
            continue
        bad.append(shown(a))
        out.append(utf8_text(a))
    if bad:
        noun = "argument " + bad[0] + " is" if len(bad) == 1 else "arguments " + ", ".join(bad) + " are"
        err(f"warning: {noun} not valid UTF-8: {REPLACED}")
    return out


def _read_stdin() -> str:
    """All of stdin as text. Bytes that are not UTF-8 are replaced with one warning rather than
    refused: a Latin-1 file piped in still gets an answer, and the warning says what changed."""
    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:  # a text-only stream (an embedding program's): already decoded
        return utf8_text(sys.stdin.read())
    data = raw.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        err(f"warning: stdin is not valid UTF-8 (first bad byte at offset {e.start}): {REPLACED}")
        return data.decode("utf-8", "replace")


def read_prompt(prompt: str | None, required: bool = True) -> str | None:
    """stdin (when piped) comes first, then the PROMPT argument, as `llm` and `ollama` do.
    A closed stdin reads as empty."""
    parts = []
    if sys.stdin is not None and not sys.stdin.isatty():
        data = _read_stdin()
        if data.strip():
            parts.append(data.rstrip("\n"))
    if prompt:
        parts.append(utf8_text(prompt))
    text = "\n".join(parts)
    if not text.strip():
        if not required:
            return None
        raise LocalkvError("empty prompt: pass PROMPT or pipe text on stdin")
    return text


def warn_disk(engine):
    if engine.disk is not None and engine.disk.warning:
        err(f"warning: {engine.disk.warning}")


# ---------------------------------------------------------------- standard streams


class OutputError(LocalkvError):
    """stdout cannot be written: a full disk, a closed descriptor, a terminal that hung up."""


class _Stdout(io.RawIOBase):
    """File descriptor 1 with its write errors turned into OutputError (a broken pipe stays a
    BrokenPipeError: the reader left, as `head` does, which is not an error). After the first
    failure writes are dropped, so the interpreter's last flush cannot fail a second time."""

    def __init__(self, fd: int | None):
        self.fd = fd  # None: stdout was closed when localkv started
        self.failed = False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        if self.fd is None:
            raise OSError("stdout is closed")
        return self.fd

    def isatty(self) -> bool:
        return self.fd is not None and os.isatty(self.fd)

    def write(self, b) -> int:
        if self.failed:
            return len(b)
        try:
            if self.fd is None:
                raise OutputError("cannot write output (stdout is closed)")
            return os.write(self.fd, b)
        except BrokenPipeError:
            self.failed = True
            raise
        except OSError as e:
            self.failed = True
            raise OutputError(f"cannot write output ({e.strerror or e})") from None
        except OutputError:
            self.failed = True
            raise


def _checked_stdout(out) -> io.TextIOWrapper:
    """A text stream like out (the process's stdout, or None when it was closed) over _Stdout."""
    if out is None:
        return io.TextIOWrapper(io.BufferedWriter(_Stdout(None)), encoding="utf-8")
    with contextlib.suppress(OSError):
        out.flush()
    raw = io.BufferedWriter(_Stdout(out.fileno()))
    return io.TextIOWrapper(raw, encoding=out.encoding, errors=out.errors, line_buffering=out.line_buffering)


@contextlib.contextmanager
def guarded_stdio():
    """For the length of one command: a closed stdin reads as empty and a closed stderr swallows
    messages (both /dev/null, which also keeps a later open() from taking descriptor 0 or 2), and
    writes to the real stdout fail as OutputError, one clear line, instead of an internal error.
    A stdout that is not the process's own (a test's capture) is left alone."""
    saved = sys.stdin, sys.stdout, sys.stderr
    with contextlib.ExitStack() as stack:
        try:
            for name, mode in (("stdin", "r"), ("stdout", "w"), ("stderr", "w")):
                if getattr(sys, name) is None:  # its descriptor was closed when Python started
                    setattr(sys, name, stack.enter_context(open(os.devnull, mode, encoding="utf-8")))
            if saved[1] is None or saved[1] is sys.__stdout__:
                sys.stdout = _checked_stdout(saved[1])
            yield
        finally:
            if sys.stdout is not saved[1]:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()  # an interrupted command's output: best effort
            sys.stdin, sys.stdout, sys.stderr = saved
