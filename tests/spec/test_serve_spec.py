"""The server with --spec ngram and draft: the same answers, usage that says how many drafted tokens were
accepted and rejected, and /metrics counters of drafted and accepted tokens."""

import httpx
import pytest

from localkv.config import EngineConfig, ServeOptions
from localkv.serve.metrics import parse
from localkv.serve.server import BackgroundServer
from tiny_model import write_gguf

BODY = {"prompt": "abc abc abc abc abc", "max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("serve-spec") / "tiny.gguf", ctx=512)


def ask(path, spec: str, **kw) -> tuple[dict, dict]:
    cfg = EngineConfig(model=str(path), disk_cache=False, kv_mem="8MiB", spec=spec, **kw)
    with BackgroundServer(cfg, ServeOptions(port=0)) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
        return r.json(), parse(c.get("/metrics").text)


def test_the_server_reports_drafted_and_accepted_tokens(tiny):
    plain, _ = ask(tiny, "off")
    got, m = ask(tiny, "ngram")
    assert got["choices"][0]["text"] == plain["choices"][0]["text"]
    assert "completion_tokens_details" not in plain["usage"]
    d = got["usage"]["completion_tokens_details"]
    accepted, rejected = d["accepted_prediction_tokens"], d["rejected_prediction_tokens"]
    assert accepted > 0 and accepted <= got["usage"]["completion_tokens"]
    assert m["localkv_n_drafted_total"] == accepted + rejected
    assert m["localkv_n_drafted_accepted_total"] == accepted
    assert m["localkv_n_verify_passes_total"] > 0
    assert m['localkv_n_drafted_accepted_per_pos_total{position="1"}'] > 0


def test_the_server_verifies_a_draft_models_tokens(tiny):
    plain, _ = ask(tiny, "off")
    got, m = ask(tiny, "draft", draft_model=str(tiny))
    assert got["choices"][0]["text"] == plain["choices"][0]["text"]
    d = got["usage"]["completion_tokens_details"]
    assert d["accepted_prediction_tokens"] > 0 and d["rejected_prediction_tokens"] == 0
    assert m["localkv_n_drafted_accepted_total"] == d["accepted_prediction_tokens"]
