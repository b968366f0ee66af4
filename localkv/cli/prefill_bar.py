"""A long prefill's progress bar on stderr, only when stderr is a terminal."""

import sys
from typing import TextIO

from localkv.progress import PrefillProgress

WIDTH = 24


class PrefillBar:
    """The callback a Generation reports prefill progress to. It draws once the prefill is
    expected to last long (PrefillProgress.long), redraws in place, and erases itself when the
    prefill ends, so the reply starts on a clean line. Off a terminal it does nothing."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.on = _isatty(self.stream)
        self.shown = False

    def __call__(self, p: PrefillProgress) -> None:
        if not self.on:
            return
        if p.finished:
            self.close()
            return
        if not self.shown and not p.long:
            return
        filled = WIDTH * p.done // max(p.total, 1)
        bar = "#" * filled + "." * (WIDTH - filled)
        self._write(f"\r\x1b[2K[{bar}] {p.summary()}")
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self._write("\r\x1b[2K")
            self.shown = False

    def _write(self, text: str):
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a terminal that went away: the reply matters more
            self.on = False


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False
