"""Token sampling as llama.cpp and Ollama users know it: a grammar mask, repetition penalties
over the branch's recent tokens and DRY (dry.py), top-k, temperature, top-p, min-p and a seeded
draw; and the log-probabilities of what was drawn.

The order, one pass per token: mask -> penalties -> DRY -> top-k -> temperature -> top-p ->
min-p -> draw (llama.cpp's default chain has penalties, then DRY). Log-probabilities are the
log-softmax of the row after the mask and the penalties (DRY's too), at temperature 1 and
before any truncation: what the model, so constrained and penalized, thinks of every token
(OpenAI's and llama-server's default reading), finite for every token the grammar allows and
the same whatever the temperature, so a greedy run still reports them.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from localkv.dry import DEFAULT_BREAKERS, apply_dry
from localkv.errors import LocalkvError

CONSTRAINT_KINDS = ("json", "json_schema", "grammar", "regex")
MAX_LOGPROBS = 20  # top alternatives per token, OpenAI's limit
Law = tuple[np.ndarray, np.ndarray]  # a distribution: token ids and their probabilities


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the reply must match: `json` (any JSON object), `json_schema` (text: a JSON Schema),
    `grammar` (text: Lark or GBNF) or `regex`. grammar.py compiles it against a vocabulary. With
    a `trigger`, the reply is free until the trigger appears; the grammar, which starts with the
    trigger, holds from there on (llama.cpp's lazy grammars)."""

    kind: str
    text: str = ""
    source: str = ""  # where the text came from (a file name), for error messages
    trigger: str = ""  # a lazy grammar: free text until this text, the grammar from it on (tool calls)

    def validate(self) -> "Constraint":
        if self.kind not in CONSTRAINT_KINDS:
            raise LocalkvError(f"unknown output format {self.kind!r}: use one of {', '.join(CONSTRAINT_KINDS)}")
        if self.kind != "json" and not self.text.strip():
            what = self.kind.replace("_", " ") + (f" in {self.source}" if self.source else "")
            raise LocalkvError(f"empty {what}: nothing to constrain the reply to")
        return self


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one reply is sampled and when it stops."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int | None = None
    max_tokens: int = 512  # most tokens per reply
    ignore_eos: bool = False  # keep generating past end-of-sequence tokens
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one; 0 = off
    repeat_penalty: float = 1.0  # recent tokens' logits: positive ones divided by it, negative ones multiplied
    repeat_last_n: int = 64  # how many recent tokens (prompt included) the penalties look at; -1 = all, 0 = off
    presence_penalty: float = 0.0  # subtracted once from the logit of every recent token
    frequency_penalty: float = 0.0  # subtracted per occurrence among the recent tokens
    dry_multiplier: float = 0.0  # DRY (dry.py): how hard a token that continues a repeat is hit; 0 = off
    dry_base: float = 1.75  # DRY's penalty grows by this factor per repeated token past the allowed length
    dry_allowed_length: int = 2  # DRY: repeats up to this long go unpenalized
    dry_penalty_last_n: int = -1  # how many recent tokens (prompt included) DRY looks at; -1 = all, 0 = off
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_BREAKERS  # a token with one in its text ends a repeat
    stop: tuple[str, ...] = ()  # strings that end the reply; not part of it
    logprobs: int | None = None  # record each token's log-probability and this many top alternatives
    constraint: Constraint | None = None  # structured output (grammar.py)
    think: bool = True  # a thinking model thinks (its template's switch; reasoning.py)
    reasoning_budget: int = -1  # most tokens it thinks before its closing tag is forced; -1: no limit, 0: off

    def __post_init__(self):
        for name in ("stop", "dry_sequence_breakers"):
            v = getattr(self, name)
            if isinstance(v, str):
                object.__setattr__(self, name, (v,))
            elif not isinstance(v, tuple):
                object.__setattr__(self, name, tuple(v or ()))

    def validate(self) -> "SamplingParams":
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise LocalkvError(f"invalid temperature {self.temperature}: must be a finite number >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise LocalkvError(f"invalid top-k {self.top_k}: must be >= 0 (0 = off)")
        if not (0 < self.top_p <= 1):
            raise LocalkvError(f"invalid top-p {self.top_p}: must be in (0, 1]")
        if not (0 <= self.min_p <= 1):
            raise LocalkvError(f"invalid min-p {self.min_p}: must be in [0, 1] (0 = off)")
        if not (self.repeat_penalty > 0 and math.isfinite(self.repeat_penalty)):
            raise LocalkvError(f"invalid repeat penalty {self.repeat_penalty}: must be a finite number > 0 (1 = off)")
        if self.repeat_last_n < -1:
            raise LocalkvError(f"invalid repeat-last-n {self.repeat_last_n}: must be >= 0, or -1 for all tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise LocalkvError(f"invalid {name.replace('_', ' ')} {getattr(self, name)}: must be a finite number")
        self._validate_dry()
        if self.seed is not None and self.seed < 0:
            raise LocalkvError(f"invalid seed {self.seed}: must be >= 0")
        if self.max_tokens < 1:
            raise LocalkvError(f"invalid max tokens {self.max_tokens}: must be >= 1")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise LocalkvError("invalid stop string: an empty one would stop before the first token")
        if self.reasoning_budget < -1:
            raise LocalkvError(f"invalid reasoning budget {self.reasoning_budget}: must be >= 0, or -1 for no limit")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise LocalkvError(f"invalid logprobs {self.logprobs}: must be in 0..{MAX_LOGPROBS} (top alternatives)")
        if self.constraint is not None:
            self.constraint.validate()
            if self.ignore_eos:
                raise LocalkvError("--ignore-eos does not go with a constrained output: the end token ends the match")
        return self

    def _validate_dry(self) -> None:
        if not (self.dry_multiplier >= 0 and math.isfinite(self.dry_multiplier)):
            raise LocalkvError(f"invalid DRY multiplier {self.dry_multiplier}: must be a finite number >= 0 (0 = off)")
        if not (self.dry_base >= 1 and math.isfinite(self.dry_base)):
            raise LocalkvError(f"invalid DRY base {self.dry_base}: must be a finite number >= 1")
        if self.dry_allowed_length < 0:
            raise LocalkvError(f"invalid DRY allowed length {self.dry_allowed_length}: must be >= 0")
        if self.dry_penalty_last_n < -1:
            raise LocalkvError(
                f"invalid DRY penalty-last-n {self.dry_penalty_last_n}: must be >= 0, or -1 for all tokens"
            )
        if any(not isinstance(s, str) or not s for s in self.dry_sequence_breakers):
            raise LocalkvError("invalid DRY sequence breaker: must be a non-empty string")

    @property
    def thinks(self) -> bool:
        """Whether a thinking model thinks: on, with a budget other than 0 (0 is off)."""
        return self.think and self.reasoning_budget != 0

    @property
    def repeats(self) -> bool:
        """Whether a repetition penalty (repeat, presence, frequency) changes a logit."""
        active = self.repeat_penalty != 1 or self.presence_penalty or self.frequency_penalty
        return bool(active) and self.repeat_last_n != 0

    @property
    def dry(self) -> bool:
        """Whether DRY changes a logit."""
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes a logit."""
        return self.repeats or self.dry

    @property
    def lookback(self) -> int:
        """How many recent tokens the penalties read: -1 all, 0 none."""
        spans = [n for n, on in ((self.repeat_last_n, self.repeats), (self.dry_penalty_last_n, self.dry)) if on]
        return -1 if -1 in spans else max(spans, default=0)

    def for_branch(self, i: int) -> "SamplingParams":
        """Branch i of a fork samples with seed + i: reproducible, and not the same reply n times."""
        return self if self.seed is None or i == 0 else replace(self, seed=self.seed + i)

    def as_dict(self) -> dict:
        """What the conversation log records with a reply."""
        keys = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens")
        d = {f: getattr(self, f) for f in keys}
        if self.repeats:
            d |= {f: getattr(self, f) for f in _PENALTIES}
        if self.dry:
            d |= {f: getattr(self, f) for f in _DRY} | {"dry_sequence_breakers": list(self.dry_sequence_breakers)}
        if self.stop:
            d["stop"] = list(self.stop)
        if self.constraint is not None:
            d["format"] = self.constraint.kind
        if not self.thinks:
            d["think"] = False
        elif self.reasoning_budget >= 0:
            d["reasoning_budget"] = self.reasoning_budget
        return d


_PENALTIES = ("repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty")
_DRY = ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n")


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One sampled token's log-probability and the `top` most likely tokens with theirs (highest
    first), read from the row the sampler drew from (see the module's docstring)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = field(default=())


class Matcher(Protocol):
    """A grammar's state for one branch (grammar.py builds them)."""

    def allowed(self) -> np.ndarray | None: ...  # bool per token id: may come next (None: any token)

    def accept(self, token: int) -> None: ...  # the token drawn; advances the state

    def copy(self) -> "Matcher": ...  # an independent matcher at the same position

    def guide(self, draft: list[int], limit: int) -> list[int]: ...  # a prompt-lookup draft made valid here


def top_k_indices(row: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values of a 1-D row (in no particular order). The k-th largest
    group maximum bounds the k-th largest value from below (k groups reach it), so only the
    values at or above it compete, which beats argpartition over a whole vocabulary (this runs
    once per branch per step). A group is every (n // chunk)-th value: their maxima are one
    elementwise pass down the columns, where numpy reduces rows of 64 one loop per row, slower
    than the argpartition it saves."""
    n = row.size
    chunk = 64
    if n < 4 * chunk * k:
        return np.argpartition(row, -k)[-k:]
    full = n // chunk * chunk
    peaks = row[:full].reshape(chunk, -1).max(axis=0)
    floor = np.partition(peaks, -k)[-k]
    cand = np.flatnonzero(row >= floor)  # the tail past `full` is compared too
    return cand[np.argpartition(row[cand], -k)[-k:]]


def recent(history: Sequence[int], n: int) -> Sequence[int]:
    """The tokens the penalties look at: the last n (-1: all, 0: none)."""
    if n == 0:
        return ()
    return history if n < 0 or len(history) <= n else history[-n:]


def apply_penalties(row: np.ndarray, tokens: Sequence[int], repeat=1.0, presence=0.0, frequency=0.0) -> None:
    """llama.cpp's penalties, in place, for every distinct token t among `tokens` (c times):
    logit / repeat if it is positive, else logit x repeat; then logit - c x frequency - presence."""
    if len(tokens) == 0:
        return
    ids, counts = np.unique(np.asarray(tokens, dtype=np.int64), return_counts=True)
    inside = (ids >= 0) & (ids < row.size)
    ids, counts = ids[inside], counts[inside]
    if repeat != 1:
        v = row[ids]
        row[ids] = np.where(v > 0, v / repeat, v * repeat)
    if presence or frequency:
        row[ids] -= (counts * frequency + presence).astype(row.dtype)


def apply_mask(row: np.ndarray, allowed: np.ndarray) -> None:
    """-inf, in place, for every token not allowed (and for ids past the mask: a model's padded rows)."""
    n = min(row.size, allowed.size)
    row[:n][~allowed[:n]] = -np.inf
    row[n:] = -np.inf


def log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    top = x.max()
    with np.errstate(divide="ignore"):
        return x - top - np.log(np.exp(x - top).sum())


class Sampler:
    """Draws one token per call from a logits row. `history` is the branch's tokens so far (the
    prompt's included, as llama.cpp's penalty window has them); a grammar `matcher` masks the row
    and is advanced by the token drawn. With params.logprobs set, `last` holds the drawn token's
    TokenLogprob after each call."""

    def __init__(
        self,
        params: SamplingParams,
        matcher: Matcher | None = None,
        stream: int = 0,
        breakers: np.ndarray | None = None,
    ):
        """stream: another random stream of the same seed (a draft model's draws are made apart
        from the target's: the acceptance rule needs them independent). breakers: DRY's sequence
        breakers, a bool per token id (the tokenizer's breaker_mask; None: no token breaks)."""
        params.validate()
        self.p = params
        self.breakers = breakers
        seed = params.seed if params.seed is None or not stream else [params.seed, stream]
        self.rng = np.random.default_rng(seed)
        self.matcher = matcher
        self.last: TokenLogprob | None = None

    def __call__(
        self, logits: np.ndarray, history: Sequence[int] = (), draft: int | None = None, q: Law | None = None
    ) -> int:
        """The next token. draft: a speculative draft's token for this position. Proposed with
        certainty (prompt lookup: q None, one-hot), the token is drawn exactly as without a
        draft, one draw of this sampler's stream, and the caller keeps the draft where they
        agree: accepted with probability p(draft), as the rule for a one-hot q has it, and the
        text is the one no speculation gives, whatever was drafted or how long. Drawn from a
        draft model's law q (distribution() of its row), it is accepted with probability
        min(1, p/q), else replaced by a draw from max(0, p - q) renormalised (Leviathan et
        al.): the token's law is p's. Greedy returns the argmax as without a draft."""
        allowed = self.matcher.allowed() if self.matcher is not None else None
        row, cand = self.masked(logits, history, allowed)
        tok = self._draw(row, cand, draft, q)
        if self.matcher is not None:
            self.matcher.accept(tok)
        if self.p.logprobs is not None:
            self.last = self._logprob(row, tok)
        return tok

    def masked(self, logits: np.ndarray, history: Sequence[int], allowed: np.ndarray | None):
        """adjusted()'s row and the ids the mask allows (None: all)."""
        row = self.adjusted(logits, history, allowed)
        cand = None if allowed is None else np.flatnonzero(allowed[: row.size])
        if cand is not None and cand.size == 0:
            raise LocalkvError("the grammar allows no token of this model's vocabulary next: it cannot be matched")
        return row, cand

    def propose(self, logits: np.ndarray, history: Sequence[int], allowed: np.ndarray | None) -> tuple[int, Law | None]:
        """A draft model's token for this position and the law it was drawn from (None when
        greedy: the argmax), after the same transforms as a draw of __call__."""
        row, cand = self.masked(logits, history, allowed)
        if self.p.temperature == 0:
            return self._draw(row, cand), None
        idx, probs = self._distribution(row, cand)
        return int(idx[self.rng.choice(len(idx), p=probs)]), (idx, probs)

    def adjusted(
        self, logits: np.ndarray, history: Sequence[int] = (), allowed: np.ndarray | None = None
    ) -> np.ndarray:
        """The row after the grammar mask (`allowed`), the penalties and DRY; logits itself when
        none applies."""
        p = self.p
        window = recent(history, p.repeat_last_n) if p.repeats else ()
        dry = recent(history, p.dry_penalty_last_n) if p.dry else ()
        if allowed is None and len(window) == 0 and len(dry) < 2:
            return logits
        row = np.array(logits, dtype=np.float32)
        if allowed is not None:
            apply_mask(row, allowed)
        apply_penalties(row, window, p.repeat_penalty, p.presence_penalty, p.frequency_penalty)
        apply_dry(row, dry, p.dry_multiplier, p.dry_base, p.dry_allowed_length, self.breakers)
        return row

    def _draw(self, logits: np.ndarray, cand: np.ndarray | None, draft: int | None = None, q: Law | None = None) -> int:
        """cand: the ids a mask allows (None: all). The rest of a masked row is -inf: drawing
        among cand alone gives the same result without scanning the whole vocabulary."""
        p = self.p
        if p.temperature == 0:
            return int(np.argmax(logits)) if cand is None else int(cand[np.argmax(logits[cand])])
        idx, probs = self._distribution(logits, cand)
        if draft is not None and q is not None:
            return self._accept_or_resample(logits.size, idx, probs, draft, q)
        return int(idx[self.rng.choice(len(idx), p=probs)])

    def _accept_or_resample(self, size: int, idx: np.ndarray, probs: np.ndarray, draft: int, q: Law) -> int:
        """The rule for a draft drawn from q: keep it with probability min(1, p/q), else draw
        from the residual max(0, p - q), renormalised (its mass is what q took from p)."""
        pv, qv = np.zeros(size), np.zeros(size)
        pv[idx], qv[q[0]] = probs, q[1]
        if not qv[draft] > 0:
            raise RuntimeError(f"draft token {draft} has no mass in its law q: a bug in the caller's logic")
        if self.rng.random() * qv[draft] < pv[draft]:
            return draft
        rest = np.maximum(pv - qv, 0.0)
        if not rest.sum() > 0:  # p == q up to rounding: a rejection had probability ~0
            rest = pv
        ids = np.flatnonzero(rest)
        return int(ids[self.rng.choice(len(ids), p=rest[ids] / rest[ids].sum())])

    def _distribution(self, logits: np.ndarray, cand: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The ids a draw may give and their probabilities, after top-k, temperature, top-p and
        min-p (most likely first)."""
        p = self.p
        if cand is not None:
            idx = cand[top_k_indices(logits[cand], p.top_k)] if 0 < p.top_k < cand.size else cand
        elif 0 < p.top_k < logits.size:
            idx = top_k_indices(logits, p.top_k)
        else:
            idx = np.arange(logits.size)
        sub = logits[idx].astype(np.float64)
        order = np.argsort(-sub, kind="stable")
        idx, sub = idx[order], sub[order]
        # shift before scaling: every value is <= 0, so any temperature > 0 (subnormal ones too)
        # gives exponents in [-inf, 0] and a valid distribution; tiny ones put all mass on the top
        with np.errstate(over="ignore"):
            probs = np.exp((sub - sub[0]) / p.temperature)  # masked tokens: exp(-inf) = 0
        probs /= probs.sum()
        if p.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            idx, probs = idx[:keep], probs[:keep] / probs[:keep].sum()
        if p.min_p > 0:  # probs are sorted: the kept ones are a head
            keep = max(1, int(np.count_nonzero(probs >= p.min_p * probs[0])))
            idx, probs = idx[:keep], probs[:keep] / probs[:keep].sum()
        return idx, probs

    def _logprob(self, row: np.ndarray, tok: int) -> TokenLogprob:
        lp = log_softmax(row)
        n = min(self.p.logprobs or 0, lp.size)
        top: tuple[tuple[int, float], ...] = ()
        if n:
            idx = top_k_indices(lp, n)
            idx = idx[np.argsort(-lp[idx], kind="stable")]
            top = tuple((int(i), float(lp[i])) for i in idx if np.isfinite(lp[i]))
        return TokenLogprob(tok, float(lp[tok]), top)
