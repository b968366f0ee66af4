"""Drafting with a draft model (--spec draft): a small model of the target's vocabulary, run by
an engine of its own (its K/V in its own pool, sized from the same --kv-mem; its prefix cache
keyed by its own fingerprint), proposes the next tokens one by one, each drawn under the
branch's own sampling transforms (penalties, top-k/p, min-p, a copy of the grammar matcher),
and keeps the law q each was drawn from for the acceptance rule (Sampler.__call__ with q).

Each branch has one draft sequence. It holds the branch's verified tokens and the last draft's
tokens; at the next proposal it is rolled back to the longest prefix it shares with the verified
tokens (the accepted part of the draft) and fed the rest, so the draft model only ever computes
a token once per proposal. The draft engine is duck-typed (engine.Engine): this module sits
below it."""

from dataclasses import dataclass, field

from localkv.errors import BudgetReached, LocalkvError, PoolExhausted
from localkv.sampling import Law, Matcher, Sampler
from localkv.sequence import Sequence


def check_vocabulary(target_tok, draft_tok, name: str) -> None:
    """Raise LocalkvError unless the draft's tokenizer has the target's tokens, id for id: a
    draft's token ids are verified as the target's."""
    n, m = target_tok.vocab_size, draft_tok.vocab_size
    if n != m:
        raise LocalkvError(f"--draft-model {name}: its vocabulary has {m} tokens, the model's {n}: not its tokenizer")
    bad = next((i for i in range(n) if target_tok.token_bytes(i) != draft_tok.token_bytes(i)), None)
    if bad is not None:
        raise LocalkvError(f"--draft-model {name}: token {bad} differs from the model's: not its tokenizer")


@dataclass(slots=True)
class DraftModel:
    """One branch's drafting by a draft model. `sampler`: the draft's own (the branch's params, a
    random stream apart from the branch's); `target`: the branch's sampler, whose grammar
    matcher the draft copies; `stop_ids`: tokens that end a reply (a draft stops after one)."""

    engine: object  # the draft model's Engine
    sampler: Sampler
    target: Sampler
    stop_ids: frozenset
    prompt_len: int
    seq: Sequence | None = None
    tokens: list[int] = field(default_factory=list)  # the proposal for the verified tokens below
    laws: list[Law | None] = field(default_factory=list)  # each proposed token's q (None: greedy)
    verified: int = -1  # the verified length the proposal follows (-1: none)
    _matcher: Matcher | None = None  # the grammar's position after the proposal's tokens

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens to follow `tokens` (all verified). The same verified tokens asked again
        (a step planned anew) get the same proposal, cut or drafted further."""
        if k <= 0:
            return []
        if self.verified != len(tokens):
            self._sync(tokens)
        while len(self.tokens) < k and not (self.tokens and self.tokens[-1] in self.stop_ids):
            if not self._draft_one(tokens):
                break
        return self.tokens[:k]

    def law(self, i: int) -> Law | None:
        return self.laws[i]

    def close(self) -> None:
        """Free the draft sequence (its prompt's full blocks to the draft's disk tier first)."""
        if self.seq is not None:
            self.engine.persist_prompt(self.seq, self.prompt_len)
            self.engine.free(self.seq)
        self.seq, self.verified = None, -1
        self.tokens, self.laws = [], []

    def _sync(self, tokens: list[int]) -> None:
        """Roll the draft sequence back to what it shares with the verified tokens; the rest of
        them become its pending tokens. A new sequence starts from the draft's prefix cache."""
        m, seq = self.target.matcher, self.seq
        self._matcher = m.copy() if m is not None else None
        same = max(0, self.verified)  # verified tokens never change: only the draft's are compared
        self.tokens, self.laws, self.verified = [], [], len(tokens)
        if seq is None:
            self.seq, _ = self.engine.open_sequence(list(tokens))
            return
        del seq.tokens[seq.num_computed :]  # the last proposal's token that was never fed
        same = min(same, len(seq.tokens))
        while same < min(len(seq.tokens), len(tokens)) and seq.tokens[same] == tokens[same]:
            same += 1
        same = min(same, len(tokens) - 1)  # the last verified token is run again: its logits draft
        if same < len(seq.tokens):
            self.engine.rollback(seq, len(seq.tokens) - same)
        seq.tokens.extend(tokens[same:])

    def _draft_one(self, tokens: list[int]) -> bool:
        """Run the draft sequence's pending tokens and draw the next one; False when it cannot
        (its context or pool is full: the branch drafts less)."""
        eng, seq = self.engine, self.seq
        if len(seq.tokens) > eng.ctx:
            return False
        try:
            while True:
                logits = eng.forward([seq], eng.config.prefill_chunk)
                if not seq.pending:
                    break
        except (PoolExhausted, BudgetReached):
            return False
        m = self._matcher
        tok, law = self.sampler.propose(logits[0], tokens + self.tokens, m.allowed() if m is not None else None)
        if m is not None:
            m.accept(tok)
        self.tokens.append(tok)
        self.laws.append(law)
        seq.tokens.append(tok)  # pending: fed with the next token's pass
        return True
