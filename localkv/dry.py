"""DRY ("Don't Repeat Yourself"), llama.cpp's sampler against loops (p-e-w's design, pi6am's
port): a penalty only for a token that would continue a repeat, so text that merely reuses
words keeps its logits while "the the the" and a sentence said twice get stopped.

For a window w of recent tokens and a candidate token t: L(t) is the length of the longest
suffix of w that also ends at an earlier position i of w with w[i + 1] = t (overlaps allowed,
as llama.cpp's Z-algorithm finds them), counting no token past the last sequence breaker of
w. When L(t) >= allowed_length, t's logit loses multiplier x base ** (L(t) - allowed_length),
the exponent clamped where base ** x would overflow a float32, as llama.cpp clamps it. A
breaker token itself is never penalized.

A breaker is a token whose text contains one of the breaker strings: llama.cpp's rule for
single-character breakers (its defaults); a longer breaker that only a run of tokens spells
(llama.cpp's head-and-tail sequences) does not break here.
"""

import math
from collections.abc import Sequence

import numpy as np

DEFAULT_BREAKERS = ("\n", ":", '"', "*")  # llama.cpp's
_FLOAT_MAX_LOG = 88.7228391  # log(float32 max): llama.cpp's exponent clamp
_FLOAT_MAX = float(np.finfo(np.float32).max)


def breaker_mask(pieces: Sequence[bytes], breakers: Sequence[str]) -> np.ndarray:
    """A bool per token id: whether its text (raw bytes, so a byte token <0x0A> is "\\n")
    contains a breaker. A tokenizer computes it once per breaker set."""
    needles = [b.encode() for b in breakers if b]
    return np.fromiter((any(n in p for n in needles) for p in pieces), dtype=bool, count=len(pieces))


def max_exponent(base: float) -> int:
    """The largest exponent llama.cpp lets base ** x reach (0: none, for a base too close to 1)."""
    return int(_FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0


def apply_dry(
    row: np.ndarray,
    window: Sequence[int],
    multiplier: float,
    base: float,
    allowed_length: int,
    breakers: np.ndarray | None = None,
) -> None:
    """DRY's penalties on the logits row, in place, for the recent tokens `window` (oldest
    first); `breakers`: breaker_mask's (None: no token breaks a repeat)."""
    if multiplier == 0 or len(window) < 2:
        return
    w = np.asarray(window, dtype=np.int64)
    tokens, lengths = repeat_lengths(w, allowed_length, _cap(w, base, allowed_length, breakers))
    if tokens.size == 0:
        return
    keep = tokens < row.size
    if breakers is not None:
        keep &= ~_is_breaker(tokens, breakers)
    tokens, lengths = tokens[keep], lengths[keep]
    amount = multiplier * np.power(float(base), lengths - allowed_length, dtype=np.float64)
    # finite: a grammar that leaves only penalized tokens must still give a distribution, not NaN
    row[tokens] -= np.minimum(amount, _FLOAT_MAX).astype(row.dtype)


def _cap(w: np.ndarray, base: float, allowed: int, breakers: np.ndarray | None) -> int:
    """How far back a match may count: not past the last breaker, and not past the length at
    which the clamped exponent stops growing (so a long loop costs no longer scans)."""
    n = w.size
    if base == 1:
        far = allowed  # every match long enough costs the same
    else:
        top = max_exponent(base)
        far = allowed + top if top else n
    cap = min(n - 1, far)
    if breakers is not None:
        tail = w[n - 1 - cap :]  # the breakers that could cut a match short
        hit = np.flatnonzero(_is_breaker(tail, breakers))
        if hit.size:
            cap = min(cap, tail.size - 1 - int(hit[-1]))
    return cap


def _is_breaker(ids: np.ndarray, breakers: np.ndarray) -> np.ndarray:
    inside = ids < breakers.size  # a model's padded ids past the vocabulary break nothing
    return inside & breakers[np.where(inside, ids, 0)]


def repeat_lengths(w: np.ndarray, least: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """The tokens that would continue a repeat of at least `least` tokens, and for each the
    longest such repeat (at most `cap`): for every end i < n - 1, z(i) = how many tokens of w
    ending at i equal w's last ones, and w[i + 1] the token after them.

    Each token's latest end is measured first: in a loop it is the longest, which then rules
    out the token's other ends at one comparison each (z(i) can beat it only by matching at
    its length), so a loop costs O(n) rather than O(n x cap), cap being the most any end costs."""
    n = w.size
    if cap < least or n < 2:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    ends = np.arange(n - 1) if least == 0 else np.flatnonzero(w[:-1] == w[-1])
    order = np.lexsort((ends, w[ends + 1]))
    ends = ends[order]
    nxt = w[ends + 1]
    latest = np.append(nxt[1:] != nxt[:-1], True) if ends.size else np.zeros(0, bool)
    best = _match(w, ends[latest], cap)
    bound = best[np.cumsum(latest) - latest]  # for each end, its token's latest end's z
    rest, bound = ends[~latest], bound[~latest]
    rest, bound = rest[bound < cap], bound[bound < cap]
    at = rest - bound
    rest = rest[(at >= 0) & (w[np.maximum(at, 0)] == w[n - 1 - bound])]
    tokens = np.concatenate([nxt[latest], w[rest + 1]])
    lengths = np.concatenate([best, _match(w, rest, cap)])
    long = lengths >= least
    return _longest_per_token(tokens[long], lengths[long])


def _match(w: np.ndarray, ends: np.ndarray, cap: int) -> np.ndarray:
    """z(i) for each end i, at most cap: the ends still matching are extended together, in
    blocks that double in length (O(log cap) numpy passes, not a Python loop per token)."""
    n = w.size
    z = np.zeros(ends.size, np.int64)
    alive = np.arange(ends.size)
    m, step = 0, 4
    while alive.size and m < cap:
        c = min(step, cap - m)
        back = m + np.arange(c)
        pos = ends[alive, None] - back  # the tokens compared with w[n - 1 - back]
        same = (pos >= 0) & (w[np.maximum(pos, 0)] == w[n - 1 - back])
        run = np.where(same.all(axis=1), c, same.argmin(axis=1))
        z[alive] = m + run
        alive, m, step = alive[run == c], m + c, 2 * step
    return z


def _longest_per_token(tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if tokens.size == 0:
        return tokens, lengths
    order = np.lexsort((lengths, tokens))
    tokens, lengths = tokens[order], lengths[order]
    last = np.append(tokens[1:] != tokens[:-1], True)  # a token's longest comes last
    return tokens[last], lengths[last]
