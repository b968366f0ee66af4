"""Chat templates: Jinja2 in a sandbox, bounded in time and output size.

A chat template comes from the model file, which localkv does not trust (docs/SECURITY.md): the
sandbox blocks attribute and import escapes, and rendering is bounded so that a template made of
nested loops, string repetition or runaway recursion ends in one ModelError line instead of
eating the machine. The bounds are checked on every piece of output, every function call and
every arithmetic operator that can grow a value.
"""

from __future__ import annotations

import json
import operator
import threading
import time
from datetime import datetime

from jinja2.sandbox import ImmutableSandboxedEnvironment

from localkv.errors import ModelError

MAX_SECONDS = 2.0  # a real template renders in milliseconds
MAX_CHARS = 1 << 22  # output; real conversations that large do not fit any context anyway
MAX_VALUE = 1 << 20  # items or characters a single * or + may produce

_GROWING = {"*": operator.mul, "**": operator.pow, "+": operator.add}


class _Limits(threading.local):
    deadline: float = float("inf")


_limits = _Limits()


def _check_time():
    if time.monotonic() > _limits.deadline:
        raise ModelError(f"chat template took longer than {MAX_SECONDS:g} s to render (a broken or hostile template)")


def _size(x) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else 0


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(_GROWING)

    def call_binop(self, context, op, left, right):
        _check_time()
        if op == "**" and isinstance(left, int) and isinstance(right, int) and abs(right) > 64 and abs(left) > 1:
            raise ModelError("chat template computes an exponent too large to render")
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) and isinstance(n, int) and _size(seq) * n > MAX_VALUE:
                    raise ModelError("chat template repeats a value past the size limit")
        if op == "+" and _size(left) + _size(right) > MAX_VALUE:
            raise ModelError("chat template builds a value past the size limit")
        return _GROWING[op](left, right)

    def call(self, context, obj, *args, **kwargs):
        _check_time()
        return super().call(context, obj, *args, **kwargs)


def compile_template(source: str):
    """A template object whose render() is bounded; ModelError when it does not parse."""
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except Exception as e:
        raise ModelError(f"chat template does not parse: {e}") from e


def render(template, **values) -> str:
    """template.render(**values) within MAX_SECONDS and MAX_CHARS of output."""
    _limits.deadline = time.monotonic() + MAX_SECONDS
    parts, n = [], 0
    try:
        for piece in template.generate(**values):
            n += len(piece)
            if n > MAX_CHARS:
                raise ModelError(
                    f"chat template wrote more than {MAX_CHARS:,} characters (a broken or hostile template)"
                )
            _check_time()
            parts.append(piece)
    except ModelError:
        raise
    except RecursionError:
        raise ModelError("chat template recursed too deeply") from None
    except MemoryError:
        raise ModelError("chat template ran out of memory (a broken or hostile template)") from None
    except Exception as e:  # jinja errors, or a template tripping over a message's shape
        raise ModelError(f"chat template failed to render: {type(e).__name__}: {e}") from e
    finally:
        _limits.deadline = float("inf")
    return "".join(parts)


def _raise(message: str):
    raise ModelError(f"chat template rejected the conversation: {message}")
