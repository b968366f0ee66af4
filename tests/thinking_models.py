"""Tiny thinking models for the tests, and a way to make them think.

The models are scripts/make_model.py's tiny Qwen3 and DeepSeek-R1-distill recipes (the real
Qwen vocabulary, `<think>` and `</think>` single tokens, and each family's real chat template)
at smaller dimensions, written into the test's folder. Their weights are random, so they never
write `<think>...</think>` on their own: `scripted` makes every Sampler favour the tokens of a
given reply by a margin no random logit reaches, so the model writes it token by token, while
a mask (a grammar, a forced closing tag) still decides among the tokens it allows."""

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pytest

import localkv.generation
from localkv.model.tokenizer import Tokenizer
from resources import script

SMALL = {"dim": 64, "n_heads": 2, "n_kv_heads": 1, "head_dim": 32, "ffn": 128, "ctx": 4096}
MARGIN = 1e4  # above any logit of a random model


def write(folder: Path, recipe: str) -> Path:
    """The recipe ("tiny-qwen3", "tiny-r1-distill") as a small F16 GGUF in folder (a skip when
    its vocabulary or template is not fetched)."""
    mm = script("make_model")
    path = folder / f"{recipe}.gguf"
    try:
        return mm.write_gguf(dataclasses.replace(mm.RECIPES[recipe], **SMALL), path)
    except FileNotFoundError as e:
        pytest.skip(str(e))


def scripted(monkeypatch, tok: Tokenizer, *replies: str) -> None:
    """From now on, the i-th Sampler made writes replies[i] (the last one for the rest), then
    the end token; the text is tokenized as the model's own (tags as their tokens)."""
    ids = [tok.encode(r, special=True, add_bos=False) + [tok.eos_id] for r in replies]
    made = itertools.count()
    base = getattr(localkv.generation.Sampler, "unscripted", localkv.generation.Sampler)  # a script replaces one

    class Scripted(base):
        unscripted = base

        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.script, self.at = ids[min(next(made), len(ids) - 1)], 0

        def __call__(self, logits, history=(), draft=None, q=None):
            row = np.array(logits, dtype=np.float32)
            row[self.script[min(self.at, len(self.script) - 1)]] += MARGIN
            self.at += 1
            return super().__call__(row, history, draft, q)

    monkeypatch.setattr(localkv.generation, "Sampler", Scripted)
