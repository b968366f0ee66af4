"""Tool calls: a request's tools and tool_choice become a prompt (the model's own template, or a
generic system block), a grammar that makes every call parse and match its function's schema
(from the first token for `required` or a named function; lazy, from the family's trigger on,
for `auto`), and a parser that reads the calls back. `prepare` is the one entry point: the
OpenAI routes use it, and any other API on the same engine can."""

import uuid
from dataclasses import dataclass

from localkv.model.tokenizer import Tokenizer
from localkv.sampling import Constraint
from localkv.toolcalls import render
from localkv.toolcalls.formats import FAMILIES, Call, Family, detect
from localkv.toolcalls.spec import Choice, Tool, ToolError, read_choice, read_tools
from localkv.toolcalls.stream import ToolStream

__all__ = ["Call", "Choice", "Plan", "Tool", "ToolError", "ToolStream", "prepare", "read_choice", "read_tools"]


@dataclass(frozen=True, slots=True)
class Plan:
    """How one request's tool calls are asked for, constrained and read back."""

    family: Family
    tools: tuple[Tool, ...]  # what the prompt offers (with tool_choice "none" too: the same prefix)
    choice: Choice
    native: bool  # the template renders tools itself
    constraint: Constraint | None  # None: the reply is free text (tool_choice "none")

    def prompt(self, tok: Tokenizer, messages: list[dict], variables: dict | None = None) -> str:
        """variables: more of the template's (a thinking model's switch)."""
        return render.prompt(tok, messages, list(self.tools), self.family, self.native, variables)

    def parse(self, text: str) -> tuple[str, list[Call]]:
        """(content, calls) of a whole reply; no calls unless the request could make them."""
        got = self.family.parse(text) if self.constraint is not None else None
        return got if got is not None else (text, [])

    def stream(self) -> ToolStream | None:
        return ToolStream(self.family) if self.constraint is not None else None

    def new_id(self) -> str:
        """A call's id (Mistral's templates read back only 9 letters and digits)."""
        return uuid.uuid4().hex[:9] if self.family.name == "mistral" else "call_" + uuid.uuid4().hex[:24]


def prepare(tools: list[Tool] | None, choice: Choice | None, tok: Tokenizer) -> Plan:
    """The plan for tools (read_tools) and a choice (read_choice) on this tokenizer's template."""
    choice = choice or Choice("auto" if tools else "none")
    template = tok.chat_template or ""
    family = detect(template)
    native = family is not FAMILIES["generic"]
    if choice.mode == "none" or not tools:
        return Plan(family, tuple(tools or ()), choice, native, None)
    offered = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    trigger_token = _control_token(tok, family.trigger)
    lark = family.lark(offered, choice.parallel, trigger_token)
    trigger = family.trigger if choice.mode == "auto" else ""
    return Plan(family, tuple(tools), choice, native, Constraint("grammar", lark, "tools", trigger))


def _control_token(tok: Tokenizer, text: str) -> int | None:
    """The id of the control token that spells `text`, if one does (Mistral's [TOOL_CALLS])."""
    ids = tok.encode(text, special=True, add_bos=False)
    if len(ids) == 1 and tok.decode(ids, skip_special=True) == "":
        return ids[0]
    return None
