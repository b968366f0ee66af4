"""Prompt-lookup drafting (Saxena's prompt lookup decoding; vLLM's ngram proposer): the last n
tokens of a sequence, for n from n_max down to n_min, looked up among its earlier tokens, prompt
and generated alike; the tokens that followed their most recent occurrence are the draft.

The index is incremental: each token is indexed once, under the n-grams that end just before
it, so a lookup costs a few dictionary probes and the draft's own slice, whatever the length of
the context (vLLM's KMP scan of the whole context per step is what this avoids). The branches
of a fork look in each other's indexes too: a sibling that wrote the phrase a branch is in the
middle of drafts its continuation."""


class NgramIndex:
    """One sequence's n-grams -> the position just past their most recent occurrence. It reads
    the caller's token list, which may only grow between calls (verified tokens only: a draft is
    never indexed)."""

    __slots__ = ("n_min", "n_max", "_seen", "_indexed", "tokens")

    def __init__(self, n_min: int, n_max: int):
        if not 1 <= n_min <= n_max:
            raise RuntimeError(f"n-gram sizes {n_min}..{n_max}: a bug in the caller's logic")
        self.n_min, self.n_max = n_min, n_max
        self._seen: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max + 1)]  # by n
        self._indexed = 0  # tokens of the list indexed so far
        self.tokens: list[int] = []  # that list (a sibling's draft reads its continuation there)

    def update(self, tokens: list[int]) -> None:
        """Index the tokens appended since the last call: the n-grams ending just before each
        are followed by it."""
        if len(tokens) < self._indexed:
            raise RuntimeError("an n-gram index's tokens shrank: a bug in the caller's logic")
        for p in range(max(self._indexed, 1), len(tokens)):
            for n in range(self.n_min, min(self.n_max, p) + 1):
                self._seen[n][tuple(tokens[p - n : p])] = p
        self._indexed, self.tokens = len(tokens), tokens

    def draft(self, tokens: list[int], k: int, others: tuple["NgramIndex", ...] = ()) -> list[int]:
        """k tokens that followed the most recent earlier occurrence of the longest suffix of
        tokens (n_max down to n_min) seen before, here or, for a suffix not seen here, in the
        indexes of `others` (a fork's siblings: up to k of the tokens that followed it there);
        [] when none was. An occurrence here that ends less than k tokens before the end
        continues as the loop it is in (the draft copies itself), as a model repeating itself
        would."""
        self.update(tokens)
        end = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            key = tuple(tokens[end - n :])
            p = self._seen[n].get(key)
            if p is not None:
                out = tokens[p : p + k]
                for j in range(len(out), k):  # a match near the end repeats with period end - p
                    out.append(out[p + j - end])
                return out
            for o in others:
                q = o._seen[n].get(key) if o.n_min <= n <= o.n_max else None
                if q is not None:
                    return o.tokens[q : q + k]
        return []
