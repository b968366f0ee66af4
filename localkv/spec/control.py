"""How much to draft: the settings' checks, the draft length a branch earns from its
acceptance and the measured cost of a wider pass, the share each decoding sequence gets of a
step, and where speculation cannot run.

Defaults, and why: k_max 15 under prompt lookup on greedy text, since a verify pass of 1 + 15
rows is one block of the 16-row weight kernel (kernels/matmul_wide) and PassCost cuts each draft
to the length that pays (a copy drafts long, other text short or not at all); 8 on sampled text,
where a drafted token is kept only if the draw agrees, so a copy breaks sooner and a longer pass
wastes more (free chat 0.97x at 15, 0.985x at 8: BENCHMARKS.md), and with a draft model, whose
drafted tokens each cost one of its own steps, which PassCost does not see. n-grams 4 down to 2:
a 4-token match almost always continues as its source did, and 2 still finds the places where a
rewrite resumes copying; a single token matches some earlier occurrence nearly everywhere
(every "the", every "(") and drafts noise, which costs a wider pass each step on text that
quotes nothing (the free-chat control)."""

import weakref
from dataclasses import dataclass, replace

from localkv.errors import LocalkvError
from localkv.sampling import Law, Sampler
from localkv.spec.draft import DraftModel
from localkv.spec.ngram import NgramIndex
from localkv.spec.shared import SharedNgrams

MODES = ("off", "ngram", "draft")
# what the commands (run, chat, fork, serve) speculate with unless told: prompt lookup drafts only
# as long as a draft pays (PassCost), so text that copies nothing runs as fast as without it
# (BENCHMARKS.md, "Speculation by default"); EngineConfig, the library's, keeps "off"
COMMANDS_DEFAULT = "ngram"
K_MAX, K_MAX_SAMPLED, NGRAM_MAX, NGRAM_MIN = 15, 8, 4, 2
MAX_REST = 16  # most lookups a branch skips after drafts rejected outright in a row
# a drafted row's cost as a share of a 1-row decode pass, until the engine has measured it
# (scripts/verify_width.py, 1 + 8 rows: 2.05 steps on the 1B Q4_K_M, 2.59 on SmolLM2)
ROW_PRIOR = 0.2
SMOOTH = 0.2  # weight of the newest pass in the measured costs
MARGIN = 0.03  # gain a draft must promise over a plain step: timing noise is not a gain
DECAY = 0.8  # weight of a branch's earlier passes in its acceptance, each pass
# ... and each time no draft paid: the evidence fades slowly, so a branch whose drafts were
# rejected tries again now and then (a stretch of copying starts) without paying often
FADE = 0.95


def check(mode: str, k_max: int, n_max: int, n_min: int, draft_model: str | None = None) -> None:
    """Raise LocalkvError for settings no speculation runs with."""
    if mode not in MODES:
        raise LocalkvError(f"unknown --spec {mode!r}: use one of {', '.join(MODES)}")
    if mode == "draft" and not draft_model:
        raise LocalkvError("--spec draft needs --draft-model NAME|PATH (a small model of the same vocabulary)")
    if draft_model and mode != "draft":
        raise LocalkvError(f"--draft-model goes with --spec draft, not --spec {mode}")
    if not 0 <= k_max <= 64:
        raise LocalkvError(f"invalid --spec-max {k_max}: must be in 0..64 (drafted tokens per pass; 0: the default)")
    if not 1 <= n_min <= n_max <= 16:
        raise LocalkvError(
            f"invalid n-gram sizes --spec-ngram-min {n_min} --spec-ngram-max {n_max}: need 1 <= min <= max <= 16"
        )


def k_max(spec_max: int, mode: str, greedy: bool = True) -> int:
    """Most tokens a branch drafts per verify pass: --spec-max, or (0) the default of its --spec
    and its sampling (see the module's doc)."""
    return spec_max or (K_MAX if mode == "ngram" and greedy else K_MAX_SAMPLED)


def unavailable(engine) -> str:
    """Why this engine's requests cannot speculate ('' when they can): a rejected draft is rolled
    back, which a KV policy that evicted or scored for the drafted tokens cannot undo."""
    if not engine.policy.can_roll_back:
        return f"--evict {engine.policy.config.policy} cannot roll back rejected drafts"
    return ""


def share(n_decodes: int, room: int, k_max: int) -> int:
    """Most tokens each of a step's n_decodes decoding sequences may draft, with `room` tokens of
    the step's budget left after their own: k_max each for one or two sequences, less as more
    share the pass, none past 2 x k_max. A verify pass pays while it stays bound by reading the
    weights; with many sequences the pass is wide already (vLLM measured n-gram speculation
    1.8x slower at high load)."""
    if n_decodes < 1:
        return 0
    return max(0, min(k_max, min(room, 2 * k_max) // n_decodes))


class PassCost:
    """What the engine's decode passes cost, measured as they run: seconds per pass by its
    rows (one per decoding sequence, plus their drafts). One per engine (cost_of), so every
    request and turn drafts by what the machine has shown, under whatever load it has now. The
    cost is not linear in the rows (the kernels take rows in blocks); a width not yet measured
    is assumed to cost ROW_PRIOR of a 1-row pass per row, so that it is tried and then known."""

    def __init__(self, rows_max: int = 256):
        self.seconds = [0.0] * (rows_max + 1)  # [r]: a pass of r decoding rows (0: none seen yet)

    def observe(self, rows: int, seconds: float) -> None:
        """A pass whose sequences all decode (each its token and its draft) ran `rows` rows in
        `seconds`."""
        if 0 < rows < len(self.seconds):
            old = self.seconds[rows]
            self.seconds[rows] = seconds if not old else (1 - SMOOTH) * old + SMOOTH * seconds

    def ratio(self, base: int, rows: int) -> float:
        """A pass of `rows` rows as a multiple of one of `base` rows (measured, else the prior's)."""
        a, b = self.seconds[base], self.seconds[rows] if rows < len(self.seconds) else 0.0
        if a and b:
            return max(1.0, b / a)
        return (1 + ROW_PRIOR * (rows - 1)) / (1 + ROW_PRIOR * (base - 1))

    def best(self, k: int, accept: float, decoding: int = 1) -> int:
        """The draft length of at most k that makes a pass of `decoding` sequences give the most
        tokens per unit of time, when each drafted token is accepted with probability `accept`
        after its predecessors were (j drafted rows add accept + ... + accept**j tokens to the
        pass's `decoding`); 0 when no length beats the pass without it by MARGIN."""
        base = max(1, min(decoding, len(self.seconds) - 1))
        best, gain, extra, p = 0, 1.0 + MARGIN, 0.0, 1.0
        for j in range(1, k + 1):
            p *= accept
            extra += p
            g = (base + extra) / (base * self.ratio(base, base + j))
            if g > gain:
                best, gain = j, g
        return best


_LEARNED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # engine -> (PassCost, SharedNgrams)


def _learned(engine) -> tuple[PassCost, SharedNgrams]:
    got = _LEARNED.get(engine)
    if got is None:
        got = _LEARNED[engine] = (PassCost(), SharedNgrams())
    return got


def cost_of(engine) -> PassCost:
    """The engine's PassCost (the scheduler feeds it, every branch's drafting reads it)."""
    return _learned(engine)[0]


def pool_of(engine) -> SharedNgrams:
    """The engine's shared n-gram pool (every prompt-lookup branch records into it and drafts
    from it where its own context finds nothing)."""
    return _learned(engine)[1]


def forget_texts(engine) -> None:
    """Empty the engine's shared n-gram pool, if it has one (nothing is made for an engine that
    never drafted)."""
    got = _LEARNED.get(engine)
    if got is not None:
        got[1].clear()


def for_branch(mode: str, engine, sampler: Sampler, stop_ids: frozenset, prompt_len: int) -> "Speculator | None":
    """A branch's drafting under its request's --spec (None: off); `sampler` is the branch's (a
    draft model draws with its params on a random stream of its own, and a copy of its grammar
    matcher)."""
    cfg = engine.config
    if mode == "ngram":
        k = k_max(cfg.spec_max, mode, sampler.p.temperature == 0)
        return Speculator.ngram(k, cfg.spec_ngram_min, cfg.spec_ngram_max, cost_of(engine), pool_of(engine))
    if mode != "draft":
        return None
    own = Sampler(replace(sampler.p, logprobs=None), stream=1, breakers=sampler.breakers)
    model = DraftModel(engine.draft, own, sampler, stop_ids, prompt_len)
    return Speculator(None, k_max(cfg.spec_max, mode), model)  # its own steps cost too: PassCost does not see them


@dataclass(slots=True)
class Speculator:
    """One branch's drafting: its n-gram index, the draft length its acceptance earned (k), and
    its counts. k doubles after a draft accepted whole and falls to one past the accepted prefix
    after a rejection: a branch that copies its context drafts long, one that does not drafts one
    token at a time, and a new copying stretch is back to k_max within three passes. Drafts
    rejected outright in a row also rest the drafting for 1, 2, 4 .. up to MAX_REST lookups,
    so text that quotes nothing pays for a wider pass only now and then. Under prompt lookup
    the draft is then cut to the length with the most expected tokens per unit of time (the
    engine's measured PassCost, the branch's recent acceptance), and none is proposed when no
    length beats a plain step."""

    index: NgramIndex | None  # prompt lookup's (None: a draft model drafts)
    k_max: int
    model: DraftModel | None = None
    cost: PassCost | None = None  # the engine's measured pass costs (prompt lookup's; None: draft k)
    pool: SharedNgrams | None = None  # the engine's shared n-grams (prompt lookup's)
    pooled: int = 0  # tokens of the branch recorded in the pool so far
    k: int = 0
    drafted: int = 0  # tokens drafted and verified
    accepted: int = 0  # of those, accepted
    passes: int = 0  # verify passes (steps in which the branch had a draft)
    misses: int = 0  # verify passes in a row that accepted nothing
    rest: int = 0  # lookups left to skip
    steps: float = 0.0  # what its verify passes cost, in 1-row decode passes (PassCost's measure)
    taken: float = 1.0  # drafted tokens accepted, recent passes weighing more (a prior of 1)
    refused: float = 1.0  # drafted tokens rejected, likewise (at most one a pass)

    def __post_init__(self):
        self.k = self.k or self.k_max

    @classmethod
    def ngram(
        cls, k_max: int, n_min: int, n_max: int, cost: PassCost | None = None, pool: SharedNgrams | None = None
    ) -> "Speculator":
        return cls(NgramIndex(n_min, n_max), k_max, cost=cost, pool=pool)

    def acceptance(self) -> float:
        """The chance that a drafted token is accepted, its predecessors being (from the
        accepted prefixes and rejections of recent passes)."""
        return self.taken / (self.taken + self.refused)

    def propose(
        self, tokens: list[int], limit: int, siblings: tuple["Speculator", ...] = (), decoding: int = 1
    ) -> list[int]:
        """A draft of at most min(k, limit) tokens to follow `tokens` (all verified), from them or
        from the siblings' tokens (a fork's other branches), for a pass in which `decoding`
        sequences decode."""
        if self.rest:
            self.rest -= 1
            return []
        k = min(self.k, limit)
        if self.model is not None:
            return self.model.draft(tokens, k)
        self.learn(tokens)
        draft = self.index.draft(tokens, k, tuple(s.index for s in siblings if s.index is not None))
        if not draft and self.pool is not None:  # what other requests (or earlier turns) wrote
            draft = self.pool.draft(tokens, k)
        if draft and self.cost is not None:
            j = self.cost.best(len(draft), self.acceptance(), decoding)
            if not j:  # not worth a wider pass now: the evidence fades, so a copy that starts is drafted
                self.taken, self.refused = self.taken * FADE + (1 - FADE), self.refused * FADE + (1 - FADE)
            draft = draft[:j]
        return draft

    def learn(self, tokens: list[int]) -> None:
        """Record the branch's verified tokens not yet in the engine's shared pool (`tokens`
        only grows between calls, as the index's list)."""
        if self.pool is not None and len(tokens) > self.pooled:
            self.pool.record(tokens, self.pooled, len(tokens))
            self.pooled = len(tokens)

    def law(self, i: int) -> Law | None:
        """The law the draft's token i was drawn from (None: proposed with certainty, or greedy)."""
        return self.model.law(i) if self.model is not None else None

    def close(self) -> None:
        """Free what the drafting holds (a draft model's sequence): the branch ended or was preempted."""
        if self.model is not None:
            self.model.close()

    def record(self, drafted: int, accepted: int) -> None:
        """A verify pass of `drafted` tokens accepted `accepted` of them (a prefix)."""
        if not 0 <= accepted <= drafted:
            raise RuntimeError(f"{accepted} of {drafted} drafted tokens accepted: a bug in the caller's logic")
        self.drafted += drafted
        self.accepted += accepted
        self.passes += 1
        self.steps += self.cost.ratio(1, 1 + drafted) if self.cost is not None else 1 + drafted
        self.taken = DECAY * self.taken + accepted
        self.refused = DECAY * self.refused + (accepted < drafted)
        self.k = min(self.k_max, 2 * self.k) if accepted == drafted else max(1, accepted + 1)
        self.misses = self.misses + 1 if accepted == 0 else 0
        self.rest = min(MAX_REST, 1 << (self.misses - 1)) if self.misses > 1 else 0
