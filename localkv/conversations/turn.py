"""Where a new exchange attaches in the conversation tree, and saving it there."""

from dataclasses import dataclass, field

from localkv.conversations.store import ConversationStore
from localkv.errors import LocalkvError
from localkv.sampling import SamplingParams


@dataclass(slots=True)
class Turn:
    store: ConversationStore | None
    conversation_id: str | None = None  # None: a new conversation, created when saved
    parent_id: str | None = None  # the message the new one hangs under
    history: list[dict] = field(default_factory=list)  # role/content before the new message
    system: str | None = None  # system prompt of a new conversation

    def messages(self, prompt: str | None) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        tail = [{"role": "user", "content": prompt}] if prompt is not None else []
        return head + self.history + tail

    def save(
        self,
        model: str,
        prompt: str | None,
        replies: list[tuple[str, int, str]],
        prompt_tokens: int,
        sampling: SamplingParams,
    ) -> tuple[str | None, list[str]]:
        """Store the user message (unless re-sampling) and each reply (its text, token count and a
        thinking model's thinking) as siblings under it. Returns (user message id, reply ids);
        nothing when saving is off. A system prompt given to an existing conversation starts a
        new root branch."""
        if self.store is None:
            return None, []
        st = self.store
        if self.conversation_id is None:
            self.conversation_id = st.new_conversation(model)
        if self.parent_id is None and self.system:
            self.parent_id = st.add_message(self.conversation_id, None, "system", self.system, model=model)
        parent = self.parent_id
        if prompt is not None:
            parent = st.add_message(
                self.conversation_id, parent, "user", prompt, model=model, prompt_tokens=prompt_tokens
            )
        ids = [
            st.add_message(
                self.conversation_id,
                parent,
                "assistant",
                text,
                model=model,
                sampling=sampling.as_dict(),
                prompt_tokens=prompt_tokens,
                completion_tokens=n,
                reasoning=thought,
            )
            for text, n, thought in replies
        ]
        return parent, ids


def plan_turn(
    save: bool, cont: bool, cid: str | None, from_msg: str | None, system: str | None, prompt: str | None
) -> Turn:
    """Resolve -c / --cid / --from into a place in the tree (ids are checked before any model work)."""
    if sum(map(bool, (cont, cid, from_msg))) > 1:
        raise LocalkvError("use only one of -c/--continue, --cid and --from")
    if not (save or cont or cid or from_msg):
        return Turn(None, system=system)
    store = ConversationStore()
    turn = Turn(store if save else None)
    if not (cont or cid or from_msg):
        turn.system = system
        return turn
    if system:
        raise LocalkvError("-s/--system sets the system prompt of a new conversation; it cannot change an existing one")
    if from_msg:
        msg = store.get_message(store.resolve_message(from_msg))
        if prompt is None and msg.role == "assistant":
            msg = store.get_message(msg.parent_id)  # re-sample: new siblings of that reply
        elif prompt is None and msg.role != "user":
            raise LocalkvError(
                f"message {store.short_id(msg.id)} is a {msg.role} message: give a PROMPT to branch after it"
            )
        at = msg
    else:
        conv = store.resolve_conversation(cid) if cid else store.latest_conversation()
        if conv is None:
            raise LocalkvError("no saved conversation to continue: run without -c first")
        at = store.latest_leaf(conv)
        if at is None:
            raise LocalkvError(f"conversation {store.short_id(conv)} has no messages")
    turn.conversation_id, turn.parent_id = at.conversation_id, at.id
    path = store.path(at.id)
    if prompt is None and at.role == "user":  # re-sampling: the user message is already the last one
        turn.parent_id = at.id
    turn.history = [{"role": m.role, "content": m.content} for m in path]
    return turn
