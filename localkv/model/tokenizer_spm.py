"""SentencePiece-style vocabularies (GGUF tokenizer.ggml.model = "llama"): Llama 2, Mistral v0.x,
TinyLlama, Phi-3, Gemma. Encodes the way llama.cpp's SPM tokenizer does, which is not the
BPE-with-merge-list that `tokenizers` runs:

- the whole text fragment is one word: spaces become U+2581 and the text splits into characters;
- the adjacent pair whose concatenation is a token with the highest score merges first (ties:
  the leftmost pair), over and over, with any vocabulary entry allowed as a merge result;
- a leftover character that is not a token becomes its UTF-8 bytes' <0xXX> tokens.
"""

from __future__ import annotations

import heapq

SPACE = "\u2581"  # SentencePiece's visible space


class SpmEncoder:
    """llama.cpp's merge-by-score tokenizer over one vocabulary (text -> id, id -> score)."""

    def __init__(self, tokens: list[str], scores: list[float], unk_id: int | None):
        self._ids = {t: i for i, t in enumerate(tokens)}
        self._scores = [float(s) for s in scores]
        self._unk = unk_id
        self._bytes = [self._byte_token(b) for b in range(256)]

    def _byte_token(self, b: int) -> int | None:
        # llama.cpp's byte_to_token: the <0xXX> piece, else the raw one-byte text
        tid = self._ids.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:
            tid = self._ids.get(chr(b))
        return self._unk if tid is None else tid

    def encode(self, text: str) -> list[int]:
        """Token ids for one fragment; the caller has already added any prefix space."""
        text = text.replace(" ", SPACE)
        n = len(text)
        if n == 0:
            return []
        ids, scores = self._ids, self._scores
        # symbol i starts at character i and spans size[i] characters; merged-away symbols have size 0
        size = [1] * n
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []
        for i in range(n - 1):
            tid = ids.get(text[i : i + 2])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, 2))
        heapq.heapify(heap)

        def push(left: int, right: int) -> None:
            width = size[left] + size[right]
            tid = ids.get(text[left : left + width])
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, right, width))

        while heap:
            _, left, right, width = heapq.heappop(heap)
            a, b = size[left], size[right]
            if a == 0 or b == 0 or a + b != width:  # a symbol of this pair has changed since it was queued
                continue
            size[left], size[right] = width, 0
            after = nxt[right]
            nxt[left] = after
            if after != -1:
                prv[after] = left
                push(left, after)
            if prv[left] != -1:
                push(prv[left], left)
        out: list[int] = []
        i = 0
        while i != -1:
            piece = text[i : i + size[i]]
            tid = ids.get(piece)
            if tid is not None:
                out.append(tid)
            else:  # only single characters can be missing: merges always produce vocabulary entries
                out.extend(t for t in (self._bytes[b] for b in piece.encode()) if t is not None)
            i = nxt[i]
        return out


def spm_piece_bytes(text: str) -> bytes:
    """The bytes a normal SentencePiece token stands for (its U+2581 are spaces)."""
    return text.replace(SPACE, " ").encode()


def byte_piece_value(text: str) -> int | None:
    """<0xAB> -> 0xAB; None for anything else."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None
