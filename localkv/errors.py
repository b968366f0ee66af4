"""Errors a user can cause. The CLI prints their message as one line and exits non-zero."""


class LocalkvError(Exception):
    """A user-facing error: the message is the whole story, no traceback."""

    exit_code = 1


class ModelError(LocalkvError):
    """Missing, corrupt, or unsupported model file."""


class PoolExhausted(LocalkvError):
    """The KV block pool cannot hold what was asked of it."""


class ContextOverflow(LocalkvError):
    """The prompt (plus generation) does not fit the model's context."""


class BudgetReached(LocalkvError):
    """A sequence's KV budget is full and its policy cannot make room."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none): for one-line
    errors that quote a library's reason."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
