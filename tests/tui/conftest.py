"""Fixtures of the TUI tests: a tiny random model (tests/tiny_model.py) and deterministic ids."""

import itertools
from dataclasses import replace
from uuid import UUID

import pytest

from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.generation import Generation
from localkv.sampling import SamplingParams
from tiny_model import write_gguf

GREEDY = SamplingParams(temperature=0, seed=0)


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    # untied output weights: a tied random model only repeats its last token ("\n")
    return write_gguf(tmp_path_factory.mktemp("tui") / "tiny.gguf", ctx=4096, tied=False)


@pytest.fixture
def config(model_path):
    return EngineConfig(model=model_path, kv_mem="4MiB", device="cpu")  # fp32 K/V: the same text everywhere


@pytest.fixture
def engine(config):
    return Engine(config)


@pytest.fixture
def ids(monkeypatch):
    """Deterministic message ids (for snapshots): 00000000..., 00000001..."""
    counter = itertools.count()
    monkeypatch.setattr("localkv.conversations.store.uuid4", lambda: UUID(int=next(counter) << 96))


@pytest.fixture
def reference(config):
    """The greedy reply to a history, from a fresh engine without caches (what the chat must show)."""

    def reply(history: list[dict], max_tokens: int = 24):
        eng = Engine(replace(config, disk_cache=False))
        tok = eng.tokenizer
        return Generation(eng, tok.encode(tok.render_chat(history)), replace(GREEDY, max_tokens=max_tokens)).run()

    return reply


@pytest.fixture
def fake_clock():
    """Clocks that advance one step per reading: flush and rate decisions depend on the token count only."""
    return lambda step=0.01: itertools.count(0, step).__next__
