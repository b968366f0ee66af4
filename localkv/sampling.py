"""Token sampling: greedy, temperature, top-k, top-p, seeded."""

from dataclasses import dataclass

import numpy as np

from .errors import LocalkvError


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    seed: int | None = None

    def validate(self):
        if not (self.temperature >= 0):
            raise LocalkvError(f"invalid temperature {self.temperature}: must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise LocalkvError(f"invalid top-k {self.top_k}: must be >= 0 (0 = off)")
        if not (0 < self.top_p <= 1):
            raise LocalkvError(f"invalid top-p {self.top_p}: must be in (0, 1]")
        if self.seed is not None and self.seed < 0:
            raise LocalkvError(f"invalid seed {self.seed}: must be >= 0")


class Sampler:
    def __init__(self, params: SamplingParams):
        params.validate()
        self.p = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.p
        if p.temperature == 0:
            return int(np.argmax(logits))
        logits = logits.astype(np.float64) / p.temperature
        if 0 < p.top_k < logits.size:
            idx = np.argpartition(logits, -p.top_k)[-p.top_k:]
        else:
            idx = np.arange(logits.size)
        idx = idx[np.argsort(-logits[idx], kind="stable")]
        probs = np.exp(logits[idx] - logits[idx[0]])
        probs /= probs.sum()
        if p.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            idx, probs = idx[:keep], probs[:keep] / probs[:keep].sum()
        return int(idx[self.rng.choice(len(idx), p=probs)])
