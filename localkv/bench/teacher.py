"""Teacher-forced sums of one pass over a text against a reference pass over the same text:
the negative log-likelihood of each next token, the KL divergence of each distribution from
the reference's, and how often the most likely token is the reference's. One definition for
whichever engine made the logits (bench kv: localkv's formats and llama.cpp's)."""

import math

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def predicting(n_rows: int, start: int, n_tokens: int) -> int:
    """How many of a chunk's rows, the chunk starting at `start`, predict a token of the text
    (row i predicts token start + i + 1)."""
    return max(0, min(n_rows, n_tokens - 1 - start))


class Sums:
    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.nll = self.kld = 0.0
        self.same = self.count = 0

    def add(self, lp: np.ndarray, ref: np.ndarray, start: int):
        """lp, ref: log-probabilities of the rows from `start` that predict a token of the text."""
        targets = np.asarray(self.tokens[start + 1 : start + 1 + len(lp)])
        self.nll -= float(lp[np.arange(len(lp)), targets].sum())
        self.kld += float((np.exp(ref) * (ref - lp)).sum())
        self.same += int((lp.argmax(axis=1) == ref.argmax(axis=1)).sum())
        self.count += len(lp)

    def quality(self, ref_ppl: float | None) -> dict:
        ppl = math.exp(self.nll / self.count)
        return {
            "ppl": ppl,
            "ppl_vs_f16": 0.0 if ref_ppl is None else ppl / ref_ppl - 1,
            "kld": self.kld / self.count,
            "top1": self.same / self.count,
        }
