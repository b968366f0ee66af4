"""One n-gram pool per engine, shared by every request (the idea of llama.cpp's ngram-mod, PR
#19164): each verified token is recorded under a hash of the N tokens before it in a table of
fixed size, so a request drafts from what the others wrote, and from its own earlier turns, a
`/regen`'s first reply or a fork's finished branches, in bounded memory. A branch looks here
only when its own context (spec/ngram) finds nothing: the pool is a guess from other texts,
and a colliding entry only drafts a token the verify pass rejects, never a wrong one kept.
"""

import numpy as np

N = 4  # tokens of context hashed: as long as prompt lookup's longest n-gram
SLOTS = 1 << 20  # entries: 12 MiB (int64 hash, int32 token), pages touched only as written


class SharedNgrams:
    """hash(N tokens) -> the token that followed them last, in a table of `slots` entries; the
    full hash is kept beside the token, so a slot taken by another context is a miss."""

    __slots__ = ("n", "_key", "_next")

    def __init__(self, n: int = N, slots: int = SLOTS):
        if n < 1 or slots < 1:
            raise RuntimeError(f"a shared n-gram pool of n {n}, {slots} slots: a bug in the caller's logic")
        self.n = n
        self._key = np.zeros(slots, np.int64)  # 0: empty (a context hashing to 0 is never found)
        self._next = np.zeros(slots, np.int32)

    def record(self, tokens: list[int], start: int, end: int) -> None:
        """Record tokens[p] under the N before it, for p in start..end-1 (verified tokens)."""
        n, slots = self.n, len(self._key)
        for p in range(max(start, n), end):
            h = hash(tuple(tokens[p - n : p]))
            i = h % slots
            self._key[i], self._next[i] = h, tokens[p]

    def clear(self) -> None:
        """Forget every recorded text (the table keeps its size)."""
        self._key.fill(0)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens after `tokens`, each the one recorded after the N before it (the draft's
        own tokens included): [] when the context's end was never recorded."""
        n, slots = self.n, len(self._key)
        if len(tokens) < n:
            return []
        ctx, out = list(tokens[-n:]), []
        while len(out) < k:
            h = hash(tuple(ctx))
            i = h % slots
            if h == 0 or self._key[i] != h:
                break
            t = int(self._next[i])
            out.append(t)
            ctx = ctx[1:] + [t]
        return out
