"""What a Generation hands its consumer as it runs: a Delta per burst of a choice's text, one
Finished per choice, and (from the server's runner) Failed when a step broke under the request.
They are plain values, made on the engine's thread and read on another: nothing in them is
changed after they are made (llama.cpp's server results, vLLM's EngineCoreOutputs)."""

from dataclasses import dataclass

from localkv.sampling import TokenLogprob


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens a choice cost. A request's prompt is counted with its first choice only, so the
    usages of all its Finished events add up to the request's."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, found in the prefix cache
    completion_tokens: int = 0
    drafted_tokens: int = 0  # speculative tokens drafted and verified for the choice
    accepted_tokens: int = 0  # of which accepted (part of its completion)
    reasoning_tokens: int = 0  # of the completion, a thinking model's thinking (its tags included)

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.cached_tokens + other.cached_tokens,
            self.completion_tokens + other.completion_tokens,
            self.drafted_tokens + other.drafted_tokens,
            self.accepted_tokens + other.accepted_tokens,
            self.reasoning_tokens + other.reasoning_tokens,
        )


@dataclass(frozen=True, slots=True)
class Delta:
    """Text choice `choice` streamed, and the tokens sampled since its previous Delta (a token
    whose text is held back, an incomplete UTF-8 character, a possible stop string or tag, comes
    with the text that shows; the last Delta may have tokens and no text). A thinking model's
    reply comes in two parts: `reasoning` is its thinking's text, `text` its answer's, both
    without the tags (reasoning.py); one Delta may end the one and begin the other."""

    choice: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when log-probabilities were asked for
    reasoning: str = ""


@dataclass(frozen=True, slots=True)
class Finished:
    """Choice `choice` ended: its last event. ttft_s, like the prompt's usage, comes with the
    first choice only (0 on the others, and when no token was sampled)."""

    choice: int
    reason: str  # stop | length | context | kv_budget | interrupted | stopped | cancelled | error | shutdown
    detail: str = ""
    usage: Usage = Usage()
    ttft_s: float = 0.0  # from the request to its first sampled token


@dataclass(frozen=True, slots=True)
class Failed:
    """A step failed under the request, or the server is stopping: its last event, no answer."""

    message: str


Event = Delta | Finished | Failed
