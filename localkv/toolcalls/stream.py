"""A reply's text as it streams, split into what may go out as content now and the tool calls
it ends with: text from the family's trigger on (and any tail that could begin it) is held
back until the reply ends, then parsed."""

from localkv.toolcalls.formats import Call, Family


class ToolStream:
    def __init__(self, family: Family):
        self._family = family
        self._text = ""
        self._sent = 0  # characters of _text already given out as content

    def feed(self, piece: str) -> str:
        """The content that can be sent now."""
        self._text += piece
        trig = self._family.trigger
        at = self._text.find(trig, max(0, self._sent - len(trig)))
        end = at if at >= 0 else len(self._text) - _partial(self._text, trig)
        out = self._text[self._sent : max(end, self._sent)]
        self._sent = max(end, self._sent)
        return out

    def finish(self) -> tuple[str, list[Call]]:
        """(the content not sent yet, the calls) once the reply has ended."""
        got = self._family.parse(self._text)
        if got is None:
            rest, self._sent = self._text[self._sent :], len(self._text)
            return rest, []
        content, calls = got
        return content[self._sent :], calls


def _partial(text: str, trigger: str) -> int:
    """The length of the longest tail of text that begins the trigger."""
    for n in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-n:]):
            return n
    return 0
