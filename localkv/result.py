"""A request's record: each branch (reply) as it grows, and the Result a Generation fills in
and hands back: text, counts, timings, KV use and what speculation did."""

from dataclasses import dataclass, field

from localkv.model.tokenizer import TokenStreamer
from localkv.reasoning import Gate, Splitter
from localkv.sampling import Sampler, TokenLogprob
from localkv.sequence import Sequence
from localkv.spec.control import Speculator
from localkv.stops import StopScanner


@dataclass(slots=True)
class Branch:
    """One reply: its sequence, sampler, streamed text and why it ended."""

    index: int
    seq: Sequence | None  # None once the branch is finished and freed (or while preempted)
    sampler: Sampler
    streamer: TokenStreamer
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # stop | length | context | kv_budget | interrupted
    stop_detail: str = ""
    peak_active_tokens: int = 0  # most tokens of K/V the branch attended to in one layer
    stored: int = 0  # tokens of K/V it held when it finished
    stops: StopScanner = field(default_factory=lambda: StopScanner(()))
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, with params.logprobs
    streamed: int = 0  # of its tokens, those already in a Delta
    spec: Speculator | None = None  # its drafting, when the request speculates
    drafted: int = 0  # tokens of a draft at the end of seq.tokens, not yet verified
    passes: int = 0  # forward passes that gave it tokens (its first token's, the prompt's, included)
    reasoning: str = ""  # a thinking model's thinking, apart from `text` (the answer)
    split: Splitter | None = None  # how its streamed text splits into thinking and answer
    gate: Gate | None = None  # its sampler's matcher while it may think (budget, the answer's grammar)

    @property
    def reasoning_tokens(self) -> int:
        # the gate also saw the stop token that ended the reply, which is not one of its tokens
        return min(self.gate.reasoning_tokens, len(self.tokens)) if self.gate is not None else 0


@dataclass(slots=True)
class Result:
    branches: list[Branch]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    load_s: float = 0.0
    ttft_s: float = 0.0  # from the request (its prefix lookup included) to the first sampled token
    prompt_s: float = 0.0  # from the request to the prompt's logits: prefix lookup and prefill
    eval_s: float = 0.0
    peak_blocks: int = 0  # most distinct blocks this request's sequences held at once
    unshared_blocks: int = 0  # what the branches would hold without sharing
    cow_copies: int = 0  # shared blocks this request's sequences copied before writing
    spec: str = "off"  # speculation: off | ngram | draft
    spec_note: str = ""  # why it was switched off for this request ('' if it was not)

    @property
    def text(self) -> str:
        return self.branches[0].text if self.branches else ""

    @property
    def reasoning(self) -> str:
        return self.branches[0].reasoning if self.branches else ""

    @property
    def tokens(self) -> list[int]:
        return self.branches[0].tokens if self.branches else []

    @property
    def finish_reason(self) -> str:
        return self.branches[0].finish_reason if self.branches else ""

    @property
    def stop_detail(self) -> str:
        return self.branches[0].stop_detail if self.branches else ""

    @property
    def peak_active_tokens(self) -> int:
        return max((b.peak_active_tokens for b in self.branches), default=0)

    @property
    def completion_tokens(self) -> int:
        return sum(len(b.tokens) for b in self.branches)

    def speculation(self) -> dict:
        """Drafted and accepted tokens over the branches, verify passes, accepted tokens per
        verify pass, tokens per forward pass (1.0 without speculation) and the gain: tokens per
        unit of time against plain decoding, the verify passes weighed by what the engine
        measured a pass of their width to cost (spec.control.PassCost)."""
        sp = [b.spec for b in self.branches if b.spec is not None]
        drafted, accepted = sum(s.drafted for s in sp), sum(s.accepted for s in sp)
        verify, passes = sum(s.passes for s in sp), sum(b.passes for b in self.branches)
        steps = passes - verify + sum(s.steps for s in sp)
        return {
            "mode": self.spec,
            "drafted": drafted,
            "accepted": accepted,
            "verify_passes": verify,
            "accepted_per_verify": round(accepted / verify, 3) if verify else 0.0,
            "tokens_per_pass": round(self.completion_tokens / passes, 3) if passes else 0.0,
            "gain": round(self.completion_tokens / steps, 3) if steps else 0.0,
        }

    def timings(self) -> dict:
        computed = self.prompt_tokens - self.cached_tokens
        decoded = self.completion_tokens - len(self.branches)  # the first token of each comes from the prefill
        return {
            "load_s": round(self.load_s, 4),
            "ttft_s": round(self.ttft_s, 4),
            "prompt_s": round(self.prompt_s, 4),
            "prompt_tps": round(computed / self.prompt_s, 2) if self.prompt_s else 0.0,
            "eval_s": round(self.eval_s, 4),
            "eval_tps": round(decoded / self.eval_s, 2) if self.eval_s and decoded > 0 else 0.0,
        }
