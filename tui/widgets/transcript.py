"""The transcript: the messages of the branch shown, with notices between them."""

from textual.containers import VerticalScroll

from localkv.tui.widgets.message import ChatMessage, Notice


class Transcript(VerticalScroll):
    """Follows the newest message as it grows, until the user scrolls up."""

    def on_mount(self) -> None:
        self.anchor()

    async def show(self, views: list[ChatMessage]) -> None:
        """Replace everything with these messages."""
        await self.remove_children()
        await self.add(*views)

    async def add(self, *views: ChatMessage) -> None:
        await self.mount_all(views)
        self.scroll_end(animate=False)

    async def say(self, text: str, error: bool = False) -> None:
        await self.mount(Notice(text, error))
        self.scroll_end(animate=False)
