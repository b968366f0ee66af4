"""Thinking models: a reply in two parts, the thinking between tags (`<think>...</think>`) and
the answer after them. As llama.cpp's reasoning formats and vLLM's reasoning parsers, one small
rule per family, told apart by the chat template:

- qwen3: the template reads `enable_thinking` (false writes an empty, closed block in the
  prompt) and the model opens its own `<think>`;
- deepseek-r1: the template opens `<think>` in the prompt (R1 distills), so the reply starts
  inside the thinking; llama.cpp's copy of it reads `enable_thinking` too;
- think: any other template that mentions `<think>`.

Where the reply starts is read from the rendered prompt (one that ends with the open tag
starts inside). Thinking turned off uses the template's switch; a template without one gets
the closed empty block appended to the prompt, the form Qwen3's own switch writes.

Two views of one reply, by design apart: `Splitter` splits its streamed *text* (what is
shown where), `Gate` is its grammar-matcher at the *token* level (what may be sampled: the
closing tag forced once the budget is spent, the answer's own grammar from the closing tag
on, none while it thinks). Both find the same tags in the same bytes.
"""

from dataclasses import dataclass

import numpy as np

from localkv.model.tokenizer import Tokenizer
from localkv.sampling import Matcher, SamplingParams

OPENING, THINKING, ANSWER = "opening", "thinking", "answer"  # where a reply stands
SWITCH = "enable_thinking"  # the template variable Qwen3 (and llama.cpp's R1 template) read
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
# reasoning_effort / Ollama's think levels -> the thinking budget in tokens (-1: the model's own)
EFFORT = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": -1}


@dataclass(frozen=True, slots=True)
class Family:
    """How a family's template writes thinking: its tags and what marks the template as its."""

    name: str
    marks: tuple[str, ...]  # every one of these appears in the template
    open: str = "<think>"
    close: str = "</think>"

    def matches(self, template: str) -> bool:
        return all(m in template for m in self.marks)


# first match wins: the most specific rule first
FAMILIES = (
    Family("deepseek-r1", ("<｜Assistant｜><think>",)),
    Family("qwen3", ("<think>", SWITCH)),
    Family("think", ("<think>",)),
)


def family(template: str | None) -> Family | None:
    """The thinking family a chat template belongs to; None for a model that does not think."""
    return next((f for f in FAMILIES if template and f.matches(template)), None)


def variables(template: str | None, params: SamplingParams, extra: dict | None = None) -> dict:
    """The template variables of a chat prompt: a request's own (chat_template_kwargs), and the
    thinking switch for a thinking template, given always (llama.cpp's R1 template closes the
    block when it is not)."""
    out = dict(extra or {})
    if family(template) is not None:
        out[SWITCH] = params.thinks
    return out


def seal(template: str | None, prompt: str, params: SamplingParams) -> str:
    """The rendered prompt, with the closed empty block a template without a switch lacks when
    thinking is off (after an open tag: just its closing tag)."""
    fam = family(template)
    if fam is None or params.thinks:
        return prompt
    if inside(fam, prompt):
        return prompt + "\n" + fam.close + "\n\n"
    if prompt.rstrip().endswith(fam.close):  # the template's own no-thinking form
        return prompt
    return prompt + f"{fam.open}\n\n{fam.close}\n\n"


def inside(fam: Family, prompt: str) -> bool:
    """Whether a prompt leaves the reply inside the thinking (it ends with the open tag)."""
    return prompt.rstrip().endswith(fam.open)


@dataclass(frozen=True, slots=True)
class Plan:
    """One chat request's thinking: the family's tags as text and tokens, where the reply
    starts, and the budget (thinking tokens before the closing tag is forced; -1: none)."""

    family: Family
    start: str
    budget: int
    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]

    def splitter(self) -> "Splitter":
        return Splitter(self.family, self.start)

    def gate(self, tok: Tokenizer, inner: Matcher | None) -> "Gate":
        return Gate(self, tok, inner)


def plan(tok: Tokenizer, prompt: str, params: SamplingParams) -> Plan | None:
    """The thinking of a reply to this rendered chat prompt; None when the model does not think."""
    fam = family(tok.chat_template)
    if fam is None:
        return None
    start = THINKING if inside(fam, prompt) else OPENING if params.thinks else ANSWER

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, special=True, add_bos=False))

    return Plan(fam, start, params.reasoning_budget, ids(fam.open), ids(fam.close))


def chat(tok: Tokenizer, messages: list[dict], params: SamplingParams, tools=None, extra: dict | None = None):
    """(the prompt text, its reply's Plan or None) for a chat turn: the template's thinking
    switch set as params ask, `extra` template variables (a request's chat_template_kwargs),
    and `tools` (a toolcalls.Plan, which renders its own prompt)."""
    v = variables(tok.chat_template, params, extra)
    text = tools.prompt(tok, messages, v) if tools is not None else tok.render_chat(messages, True, variables=v)
    text = seal(tok.chat_template, text, params)
    return text, plan(tok, text, params)


def effort(level: str) -> tuple[bool, int]:
    """(think, budget) for a reasoning effort or an Ollama think level (EFFORT)."""
    budget = EFFORT[level]
    return budget != 0, budget


class Splitter:
    """A reply's text as it streams, split into (thinking, answer). Text that may begin a tag
    is held back until it does or cannot (as stops.py holds back a stop string's start), and so
    is whitespace at the end of the thinking: the whitespace around the thinking and between it
    and the answer is not part of either (llama.cpp trims it too)."""

    def __init__(self, fam: Family, state: str):
        self.open, self.close = fam.open, fam.close
        self.state = state
        self._held = ""
        self._lead = state != ANSWER  # drop whitespace at the start of the part now streaming

    def push(self, text: str) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        thought = ""
        while buf:
            if self.state == OPENING:
                s = buf.lstrip()
                if s.startswith(self.open):
                    self.state, buf, self._lead = THINKING, s[len(self.open) :], True
                elif not s or self.open.startswith(s):
                    self._held, buf = buf, ""
                else:  # the model answers without thinking: its text as it is
                    self.state, self._lead = ANSWER, False
                continue
            if self._lead:
                buf = buf.lstrip()
                self._lead = not buf
                continue
            if self.state == ANSWER:
                return thought, buf
            at = buf.find(self.close)
            if at >= 0:
                thought += buf[:at].rstrip()
                self.state, buf, self._lead = ANSWER, buf[at + len(self.close) :], True
                continue
            body = buf[: len(buf) - _partial(buf, self.close)]
            shown = body.rstrip()
            thought, self._held = thought + shown, buf[len(shown) :]
            buf = ""
        return thought, ""

    def flush(self) -> tuple[str, str]:
        """What is held when the reply ends: an unfinished thinking's text, or the answer's."""
        held, self._held = self._held, ""
        if self.state == THINKING:
            return (held.rstrip() if held.strip() else ""), ""
        return "", held


def _partial(text: str, tag: str) -> int:
    """The length of the longest tail of text that begins the tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class Gate:
    """A thinking reply's Matcher (the Sampler's): every token may come while it thinks, until
    `budget` tokens were sampled there: then the closing tag's tokens are the only ones allowed,
    one by one, and the answer follows. The answer's own matcher (`inner`: a JSON schema's, a
    tool call's lazy grammar) sees only the answer's tokens, so neither a grammar nor a tool
    call's trigger can bind inside the thinking. A constrained reply that may open its own
    thinking may take the open tag's first token besides what its grammar allows; that token
    means thinking, and the rest of the tag is forced."""

    def __init__(self, p: Plan, tok: Tokenizer, inner: Matcher | None):
        self.p, self._tok, self.inner = p, tok, inner
        self.state = p.start
        self.spent = 0  # tokens sampled (not forced) while thinking: what the budget counts
        self.seen = 0  # tokens of the reply so far
        self.thought = 0  # tokens up to the closing tag's last, once it came
        self._bytes = b""  # the tail not yet known not to hold a tag
        self._forced: list[int] = []
        self._dead = False  # the answer began with text its grammar cannot take

    @property
    def reasoning_tokens(self) -> int:
        """Tokens of the thinking, its tags included (the whole reply while it thinks)."""
        return self.seen if self.state == THINKING else self.thought

    def allowed(self) -> np.ndarray | None:
        """None: any token (Sampler reads it as no mask)."""
        if self._forced:
            return self._only([self._forced[0]])
        if self._dead:
            return self._only(self._tok.stop_ids)
        if self.state == ANSWER or (self.state == OPENING and self.inner is not None):
            mask = self.inner.allowed() if self.inner is not None else None
            if mask is not None and self.state == OPENING:
                mask = mask.copy()
                mask[self.p.open_ids[0]] = True
            return mask
        return None

    def accept(self, token: int) -> None:
        self.seen += 1
        forced = bool(self._forced)
        if forced and self._forced.pop(0) != token:
            raise RuntimeError(f"token {token} was drawn past a forced tag (a bug in the sampler)")
        if self.state == ANSWER:
            if self.inner is not None and not self._dead:
                self.inner.accept(token)
        elif self.state == OPENING:
            self._opening(token)
        else:
            self.spent += not forced
            self._thinking(self._tok.token_bytes(token))

    def guide(self, draft: list[int], limit: int) -> list[int]:
        """A speculative draft from here (GrammarMatcher.guide): a forced tag's tokens; in the
        answer, what its matcher makes of the draft; while thinking, the draft as it is; none
        while the reply may still open its thinking."""
        if self._forced:
            return self._forced[:limit]
        if self._dead or self.state == OPENING:
            return []
        if self.state == ANSWER and self.inner is not None:
            return self.inner.guide(draft, limit)
        return draft

    def copy(self) -> "Gate":
        """An independent gate at the same position (a draft model drafts on a copy)."""
        c = Gate.__new__(Gate)
        c.p, c._tok, c.state = self.p, self._tok, self.state
        c.inner = self.inner.copy() if self.inner is not None else None
        c.spent, c.seen, c.thought, c._bytes = self.spent, self.seen, self.thought, self._bytes
        c._forced, c._dead = list(self._forced), self._dead
        return c

    def _opening(self, token: int) -> None:
        if self.inner is not None:  # constrained: the open tag's first token, or the answer
            if token == self.p.open_ids[0]:
                self.state, self._forced = THINKING, list(self.p.open_ids[1:])
            else:
                self.state = ANSWER
                self.inner.accept(token)
            return
        self._bytes += self._tok.token_bytes(token)
        s = self._bytes.lstrip()
        tag = self.p.family.open.encode()
        if s.startswith(tag):
            self.state, self._bytes = THINKING, b""
            self._thinking(s[len(tag) :])
        elif not tag.startswith(s):
            self.state, self._bytes = ANSWER, b""

    def _thinking(self, data: bytes) -> None:
        tag = self.p.family.close.encode()
        self._bytes += data
        at = self._bytes.find(tag)
        if at >= 0:
            rest, self._bytes = self._bytes[at + len(tag) :], b""
            self.state, self.thought, self._forced = ANSWER, self.seen, []
            self._begin_answer(rest.lstrip())
            return
        self._bytes = self._bytes[-(len(tag) - 1) :]
        if 0 <= self.p.budget <= self.spent and not self._forced:
            self._forced = list(self.p.close_ids)

    def _begin_answer(self, rest: bytes) -> None:
        """Text after the closing tag inside the same token: the answer's first bytes, fed to
        its matcher as tokens of its own (the grammar never saw the token that carried them)."""
        if self.inner is None or not rest:
            return
        ids = self._tok.encode(rest.decode("utf-8", "replace"), special=False, add_bos=False)
        self._dead = not all(self.inner.feed(t) for t in ids)

    def _only(self, ids) -> np.ndarray:
        mask = np.zeros(self._tok.vocab_size, bool)
        mask[[i for i in ids if i < mask.size]] = True
        return mask
