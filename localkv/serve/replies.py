"""The answers' shapes: chat.completion and text_completion bodies, their streamed chunks (SSE
`data:` lines), usage with the prefix cache's share, and log-probabilities in both APIs' forms."""

import json
import time
import uuid
from dataclasses import dataclass, field

from localkv.generation import Branch, Result

# localkv's finish reasons -> OpenAI's (the context, the KV budget and max_tokens all cut the reply short)
FINISH = {"stop": "stop", "length": "length", "context": "length", "kv_budget": "length"}


def finish_reason(reason: str) -> str:
    return FINISH.get(reason, "stop")


def sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


DONE = "data: [DONE]\n\n"


def usage(results: list[Result]) -> dict:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results)},
    }


def token_logprobs(branch: Branch) -> list:
    """The branch's TokenLogprob records (empty when none were asked for)."""
    return list(getattr(branch, "logprobs", None) or ())


@dataclass(slots=True)
class Reply:
    """One request's answer under way: its id, clock and model name, and where each choice's
    streamed log-probabilities and text offsets stand."""

    kind: str  # chat | completion
    model: str
    n: int  # choices per prompt
    tokenizer: object
    id: str = ""
    created: int = 0
    sent_logprobs: dict[int, int] = field(default_factory=dict)  # choice index -> records sent
    offsets: dict[int, int] = field(default_factory=dict)  # choice index -> characters sent (completions)

    def __post_init__(self):
        self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _head(self) -> dict:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # ------------------------------------------------------------ whole answers

    def body(self, results: list[Result], want_logprobs: bool) -> dict:
        choices = []
        for p, r in enumerate(results):
            for b in r.branches:
                index = p * self.n + b.index
                lps = self.logprobs(index, token_logprobs(b)) if want_logprobs else None
                if self.kind == "chat":
                    msg = {"role": "assistant", "content": b.text}
                    choices.append(
                        {
                            "index": index,
                            "message": msg,
                            "logprobs": lps,
                            "finish_reason": finish_reason(b.finish_reason),
                        }
                    )
                else:
                    choices.append(
                        {
                            "index": index,
                            "text": b.text,
                            "logprobs": lps,
                            "finish_reason": finish_reason(b.finish_reason),
                        }
                    )
        return self._head() | {"choices": choices, "usage": usage(results)}

    # ------------------------------------------------------------ streamed chunks

    def chunk(
        self,
        index: int,
        text: str | None = None,
        finish: str | None = None,
        role: bool = False,
        logprobs: dict | None = None,
    ) -> str:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        head = self._head()
        head["object"] += ".chunk" if self.kind == "chat" else ""
        return sse(head | {"choices": [choice]})

    def usage_chunk(self, results: list[Result]) -> str:
        head = self._head()
        head["object"] += ".chunk" if self.kind == "chat" else ""
        return sse(head | {"choices": [], "usage": usage(results)})

    def new_logprobs(self, index: int, branch: Branch | None) -> dict | None:
        """The records of choice `index` not streamed yet, in this API's form (None when none)."""
        records = token_logprobs(branch) if branch is not None else []
        sent = self.sent_logprobs.get(index, 0)
        if len(records) <= sent:
            return None
        return self.logprobs(index, records[sent:])

    def logprobs(self, index: int, records: list) -> dict:
        self.sent_logprobs[index] = self.sent_logprobs.get(index, 0) + len(records)
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
