"""The real SmolLM2-135M-Instruct model: sense and parity with llama.cpp on the same GGUF."""

from pathlib import Path

import numpy as np
import pytest

from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.generation import Generation
from localkv.sampling import SamplingParams

pytestmark = pytest.mark.model
TEXT = (Path(__file__).parent / "data" / "apache-2.0.txt").read_text()


@pytest.fixture(scope="module")
def engine(real_model_path):
    return Engine(EngineConfig(model=real_model_path))


def test_greedy_capital_of_france_mentions_paris(engine):
    ids = engine.tokenizer.encode("The capital of France is")
    r = Generation(engine, ids, SamplingParams(temperature=0, max_tokens=16)).run()
    assert "Paris" in r.text


def test_chat_answer_mentions_paris(engine):
    tok = engine.tokenizer
    ids = tok.encode(tok.render_chat([{"role": "user", "content": "What is the capital of France?"}]))
    r = Generation(engine, ids, SamplingParams(temperature=0, max_tokens=32)).run()
    assert "Paris" in r.text and r.finish_reason == "stop"


@pytest.mark.peer
def test_logits_match_llama_cpp(engine, real_model_path):
    """Teacher-forced 256 tokens of English: top-1 agrees on >= 90% of positions and the
    mean |logit difference| is <= 0.5 (numbers recorded in the issue's closing note)."""
    import llama_cpp

    ids = engine.tokenizer.encode(TEXT)[:256]
    assert len(ids) == 256
    ours = engine.score(ids)
    llm = llama_cpp.Llama(
        model_path=str(real_model_path), n_ctx=512, n_batch=512, logits_all=True, verbose=False, n_threads=2
    )
    llm.eval(ids)
    theirs = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    top1 = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    mean_abs = float(np.abs(ours - theirs).mean())
    print(f"parity: top-1 agreement {top1:.4f}, mean |logit diff| {mean_abs:.4f}")
    assert top1 >= 0.90
    assert mean_abs <= 0.5
