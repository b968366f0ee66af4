"""The answers' shapes: chat.completion and text_completion bodies, their streamed chunks (SSE
`data:` lines), usage with the prefix cache's share, log-probabilities in both APIs' forms, and
tool calls (whole, or streamed as `tool_calls` deltas keyed by index once the reply has ended),
and a thinking model's thinking as `reasoning_content` beside `content` (llama-server's and
vLLM's field, in the message and in the streamed deltas). Everything is rendered from a
request's events (localkv/events.py), nothing else."""

import json
import time
import uuid
from dataclasses import dataclass, field

from localkv.events import Delta, Event, Finished, Usage
from localkv.sampling import TokenLogprob
from localkv.toolcalls import Call, Plan, ToolStream

# localkv's finish reasons -> OpenAI's (the context, the KV budget and max_tokens all cut the reply short)
FINISH = {"stop": "stop", "length": "length", "context": "length", "kv_budget": "length"}


def finish_reason(reason: str) -> str:
    return FINISH.get(reason, "stop")


def sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


DONE = "data: [DONE]\n\n"


def usage(u: Usage) -> dict:
    """OpenAI's usage; with speculation, its predicted-output fields say how many drafted tokens
    were accepted and rejected (present once a draft was verified)."""
    out = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
    details = {}
    if u.reasoning_tokens:
        details["reasoning_tokens"] = u.reasoning_tokens
    if u.drafted_tokens:
        details["accepted_prediction_tokens"] = u.accepted_tokens
        details["rejected_prediction_tokens"] = u.drafted_tokens - u.accepted_tokens
    if details:
        out["completion_tokens_details"] = details
    return out


@dataclass(slots=True)
class Reply:
    """One request's answer, rendered from its events: its id, clock and model name, and what
    the stream has said so far (the usage of the choices that finished, each choice's text
    offset for the completions API's log-probabilities)."""

    kind: str  # chat | completion
    model: str
    tokenizer: object
    want_logprobs: bool = False
    id: str = ""
    created: int = 0
    used: Usage = Usage()  # the Finished events' usage, summed
    offsets: dict[int, int] = field(default_factory=dict)  # choice -> characters sent (completions)
    tools: Plan | None = None  # chat with tools: the reply's calls are parsed out of its text
    held: dict[int, ToolStream] = field(default_factory=dict)  # choice -> its text held back for calls

    def __post_init__(self):
        self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _head(self, chunk: bool = False) -> dict:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        obj += ".chunk" if chunk and self.kind == "chat" else ""
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # ------------------------------------------------------------ whole answers

    def body(self, events: list[Event]) -> dict:
        """The whole answer from every Delta and Finished of a request."""
        texts: dict[int, list[str]] = {}
        thoughts: dict[int, list[str]] = {}
        records: dict[int, list[TokenLogprob]] = {}
        ends: dict[int, Finished] = {}
        for ev in events:
            if isinstance(ev, Delta):
                texts.setdefault(ev.choice, []).append(ev.text)
                thoughts.setdefault(ev.choice, []).append(ev.reasoning)
                records.setdefault(ev.choice, []).extend(ev.logprobs)
            elif isinstance(ev, Finished):
                ends[ev.choice] = ev
                self.used += ev.usage
        choices = []
        for i in sorted(ends):
            text = "".join(texts.get(i, ()))
            said, calls = self._said(text, "".join(thoughts.get(i, ())))
            lps = self.logprobs(i, records.get(i, [])) if self.want_logprobs else None
            finish = "tool_calls" if calls else finish_reason(ends[i].reason)
            choices.append({"index": i, **said, "logprobs": lps, "finish_reason": finish})
        return self._head() | {"choices": choices, "usage": usage(self.used)}

    def _said(self, text: str, thought: str = "") -> tuple[dict, list[Call]]:
        if self.kind != "chat":
            return {"text": text}, []
        content, calls = self.tools.parse(text) if self.tools is not None else (text, [])
        message = {"role": "assistant", "content": content or None if calls else content}
        if thought:
            message["reasoning_content"] = thought
        if calls:
            message["tool_calls"] = [
                {"id": self.tools.new_id(), "type": "function", "function": {"name": c.name, "arguments": a}}
                for c, a in ((c, c.arguments_json()) for c in calls)
            ]
        return {"message": message}, calls

    # ------------------------------------------------------------ streamed chunks

    def roles(self, choices: int) -> str:
        """The chat stream's first chunks: each choice's assistant role."""
        return "".join(self.chunk(i, role=True) for i in range(choices))

    def stream(self, events: list[Event]) -> str:
        """The chunks for a batch of Deltas and Finisheds: text (with its tokens'
        log-probabilities when asked for), and a finish reason per choice that ended."""
        out = []
        for ev in events:
            if isinstance(ev, Delta):
                lps = self.logprobs(ev.choice, ev.logprobs) if self.want_logprobs and ev.logprobs else None
                text = self._held(ev.choice).feed(ev.text) if self._held(ev.choice) else ev.text
                if text or ev.reasoning or lps is not None:  # tokens whose text never came show their logprobs
                    said = None if ev.reasoning and not text else text  # a thinking-only delta has no content
                    out.append(self.chunk(ev.choice, said, logprobs=lps, reasoning=ev.reasoning))
            elif isinstance(ev, Finished):
                self.used += ev.usage
                calls = self._release(ev.choice, out)
                out.append(self.chunk(ev.choice, finish="tool_calls" if calls else finish_reason(ev.reason)))
        return "".join(out)

    def _held(self, index: int) -> ToolStream | None:
        if self.tools is None or self.kind != "chat":
            return None
        if index not in self.held:
            self.held[index] = self.tools.stream()
        return self.held[index]

    def _release(self, index: int, out: list[str]) -> list[Call]:
        """A finished choice's held-back text: content, then each call as OpenAI streams one (a
        delta with its id and name, then one with its arguments)."""
        held = self._held(index)
        if held is None:
            return []
        rest, calls = held.finish()
        if rest:
            out.append(self.chunk(index, rest))
        for k, c in enumerate(calls):
            head = {"index": k, "id": self.tools.new_id(), "type": "function"}
            out.append(self.chunk(index, calls=[head | {"function": {"name": c.name, "arguments": ""}}]))
            out.append(self.chunk(index, calls=[{"index": k, "function": {"arguments": c.arguments_json()}}]))
        return calls

    def end(self, include_usage: bool) -> str:
        """The stream's last chunks: the usage if asked, then [DONE]."""
        if not include_usage:
            return DONE
        return sse(self._head(chunk=True) | {"choices": [], "usage": usage(self.used)}) + DONE

    def chunk(
        self,
        index: int,
        text: str | None = None,
        finish: str | None = None,
        role: bool = False,
        logprobs: dict | None = None,
        calls: list[dict] | None = None,
        reasoning: str = "",
    ) -> str:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if calls:
                delta["tool_calls"] = calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return sse(self._head(chunk=True) | {"choices": [choice]})

    def logprobs(self, index: int, records) -> dict:
        """Choice `index`'s records in this API's form (completions: text offsets carry on)."""
        tok = self.tokenizer
        if self.kind == "chat":
            return {
                "content": [
                    self._chat_entry(lp.token, lp.logprob)
                    | {"top_logprobs": [self._chat_entry(i, v) for i, v in lp.top]}
                    for lp in records
                ]
            }
        at = self.offsets.get(index, 0)
        tokens, offsets = [], []
        for lp in records:
            offsets.append(at)
            t = tok.token_bytes(lp.token).decode("utf-8", "replace")
            tokens.append(t)
            at += len(t)
        self.offsets[index] = at
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in records],
            "top_logprobs": [{self._text(i): v for i, v in lp.top} for lp in records],
            "text_offset": offsets,
        }

    def _text(self, token: int) -> str:
        return self.tokenizer.token_bytes(token).decode("utf-8", "replace")

    def _chat_entry(self, token: int, logprob: float) -> dict:
        raw = self.tokenizer.token_bytes(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}
