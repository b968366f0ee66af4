"""The `localkv` command line. Each module of this package registers its commands on one
Typer app (cli/app.py); main() turns every error into one line on stderr and an exit code."""

import os
import sys

import typer

from localkv.cli.app import app, err, guarded_stdio, utf8_argv
from localkv.cli.bench import bench_command
from localkv.cli.cache import cache_app
from localkv.cli.chat import chat
from localkv.cli.generate import fork, run
from localkv.cli.log import log_command
from localkv.cli.models import models, pull, rm, show
from localkv.cli.serve import serve
from localkv.errors import LocalkvError

try:  # typer >= 0.20 carries its own copy of click
    from typer._click import exceptions as _cx
except ImportError:
    from click import exceptions as _cx

for command in (pull, models, show, rm, run, fork, chat, serve):
    app.command()(command)
app.command("log", help=log_command.__doc__)(log_command)
app.add_typer(cache_app, name="cache", help="Inspect or clear the on-disk prefix cache.")
app.command("bench", help=bench_command.__doc__)(bench_command)


def main(argv: list[str] | None = None) -> int:
    """Entry point: user errors become one line on stderr and a non-zero exit, never a traceback.
    Arguments and stdin that are not UTF-8 are repaired with a warning (cli/app.py); a closed
    stdin reads as empty; stdout that cannot be written is one error line (exit 1)."""
    with guarded_stdio():
        return _main(utf8_argv(sys.argv[1:] if argv is None else list(argv)))


def _main(args: list[str]) -> int:
    try:
        # without standalone mode, a command's typer.Exit(code) comes back as the return value
        code = app(args=args, prog_name="localkv", standalone_mode=False)
        sys.stdout.flush()  # here, not at exit: a full disk or a closed stdout is reported
        return code if type(code) is int else 0
    except LocalkvError as e:
        err(f"error: {e}")
        return e.exit_code
    except typer.Exit as e:
        return e.exit_code
    except _cx.NoArgsIsHelpError as e:
        err(e.format_message() if hasattr(e, "format_message") else str(e))
        return 2
    except _cx.UsageError as e:
        err(f"error: {e.format_message()}" + (f" (see `{e.ctx.command_path} --help`)" if e.ctx else ""))
        return 2
    except (typer.Abort, KeyboardInterrupt):
        err("interrupted")
        return 130
    except BrokenPipeError:
        return 0
    except MemoryError:
        err("error: out of memory (lower --kv-mem or use a smaller model)")
        return 1
    except Exception as e:  # a bug, not bad input: still one line, the traceback on request
        if os.environ.get("LOCALKV_DEBUG"):
            raise
        err(f"error: internal error: {type(e).__name__}: {e} (set LOCALKV_DEBUG=1 for the traceback)")
        return 70


if __name__ == "__main__":
    sys.exit(main())
