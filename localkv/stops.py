"""Stop strings over streamed text: a stop string may span several tokens, so text that could
be the start of one is held back until it either completes a stop string (then it and all after
it are dropped) or can no longer (then it is released)."""

from dataclasses import dataclass


@dataclass(slots=True)
class StopScanner:
    stops: tuple[str, ...]
    held: str = ""  # text received but not released: a suffix that is a prefix of some stop string
    hit: str = ""  # the stop string found, once found

    def push(self, text: str) -> str:
        """Take newly decoded text; return what may be shown now. After a hit, nothing more."""
        if self.hit or not self.stops:
            return "" if self.hit else text
        buf = self.held + text
        # the stop string that completes first (then the longest), as if text came a character at
        # a time: how it is cut into pieces must not change where the reply ends
        done = [(i + len(s), i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if done:
            _, at, self.hit = min(done)
            self.held = ""
            return buf[:at]
        keep = self._partial(buf)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held text, when the reply ends for another reason."""
        out, self.held = self.held, ""
        return out

    def _partial(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string: a stop
        string that started inside the released text would have been a suffix of it, so none
        can span released and new text."""
        for k in range(min(len(buf), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
