"""The views of the reply being generated in `localkv chat` (one at a time): its message, the
user's message that asked for it, and a thinking model's thinking above it; and what they show
as it streams and when it ends."""

from dataclasses import dataclass

from localkv.tui.widgets.message import ChatMessage, Thinking, clean
from localkv.tui.widgets.transcript import Transcript


@dataclass(slots=True)
class Reply:
    view: ChatMessage
    user_view: ChatMessage | None
    prompt: str | None  # the text that asked for it (None: a regeneration)
    thinking: Thinking | None = None  # a thinking model's, above the view, once it thinks

    async def think(self, transcript: Transcript, text: str) -> None:
        """More of the reply's thinking, in its widget above the reply (open while it streams)."""
        if not text:
            return
        if self.thinking is None:
            self.thinking = Thinking(collapsed=False)
            await transcript.mount(self.thinking, before=self.view)
        self.thinking.append(text)

    async def chunk(self, transcript: Transcript, reasoning: str, text: str) -> None:
        await self.think(transcript, reasoning)
        if text and self.thinking is not None:
            self.thinking.collapsed = True  # the answer has begun: fold the thinking
        if text:
            await self.view.append(clean(text))

    async def finish(self, transcript: Transcript, r, tail: str, reason: str) -> None:
        """The saved result r shown in full, the frame saying what the turn cost."""
        if r.reasoning:
            await self.think(transcript, r.reasoning[len(self.thinking.text) if self.thinking else 0 :])
            self.thinking.done(r.reasoning, r.branches[0].reasoning_tokens)
        if tail:
            await self.view.append(clean(tail))
        if self.view.source != clean(r.text):  # a stop mid-character: show what was saved
            await self.view.update(clean(r.text))
        done = f"{len(r.tokens)} tok · {r.cached_tokens}/{r.prompt_tokens} cached · {reason}"
        if len(r.branches) > 1:  # a fork: what sharing the prompt's blocks saved
            done += f" · {len(r.branches)} branches in {r.peak_blocks} blocks, {r.unshared_blocks} unshared"
        self.view.border_subtitle = done

    async def withdraw(self) -> str:
        """Refused before any work: the views go; the text that asked, to edit again."""
        await self.view.remove()
        if self.user_view is not None:
            await self.user_view.remove()
        return self.prompt or ""
