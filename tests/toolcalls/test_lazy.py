"""`auto` tool calls: a lazy grammar leaves the reply free until the family's trigger, then
holds it to a valid call; the streamed reply's held-back text gives the same calls as the whole."""

import jsonschema
import numpy as np
import pytest
from test_families import SCHEMAS, TOOLS

from localkv.grammar import Grammar
from localkv.model.tokenizer import Tokenizer
from localkv.sampling import Sampler, SamplingParams
from localkv.toolcalls import Choice, ToolStream, prepare
from localkv.toolcalls.formats import FAMILIES, Call
from resources import script
from tiny_model import write_gguf


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    return Tokenizer.from_gguf(write_gguf(tmp_path_factory.mktemp("lazy") / "tiny.gguf"))


@pytest.fixture(scope="module")
def qwen_tok(vocabularies, tmp_path_factory):
    path = tmp_path_factory.mktemp("lazy") / "qwen.gguf"
    script("make_model").write_gguf(script("make_model").RECIPES["tiny-qwen2"], path, vocab_only=True)
    return Tokenizer.from_gguf(path)


def finish(tok: Tokenizer, m, ids: list[int], seed: int = 0, limit: int = 600) -> str:
    """Random logits from where `ids` left the matcher until a stop token."""
    rng = np.random.default_rng(seed)
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=seed), m)
    for _ in range(limit):
        t = s(rng.standard_normal(tok.vocab_size).astype(np.float32) * 3)
        if t in tok.stop_ids:
            return tok.decode(ids)
        ids.append(t)
    raise AssertionError(f"no end: {tok.decode(ids)!r}")


def feed(m, ids):
    for t in ids:
        assert m.allowed()[t]
        m.accept(t)


@pytest.mark.parametrize("before", ["", "Let me look that up. "])
def test_free_text_until_the_trigger_then_a_valid_call(byte_tok, before):
    plan = prepare(TOOLS, Choice("auto"), byte_tok)  # ChatML without tools: the generic form
    g = Grammar.compile(plan.constraint, byte_tok)
    m = g.matcher()
    ids = byte_tok.encode(before + '{"tool_calls": [', add_bos=False)
    for t in ids[:-1]:
        assert m.allowed().all()  # free: any token, the end ones included
        m.accept(t)
    m.accept(ids[-1])
    assert m.triggered and not m.allowed().all() and not m.allowed()[byte_tok.encode("x", add_bos=False)[0]]
    for seed in range(3):
        m = g.matcher()
        feed(m, ids)
        content, calls = plan.parse(finish(byte_tok, m, list(ids), seed))
        assert content == before and calls
        for c in calls:
            jsonschema.validate(c.arguments, SCHEMAS[c.name])


def test_a_trigger_inside_a_token_is_fed_from_its_first_byte(qwen_tok):
    """Qwen's BPE writes ' {"' as one token: the trigger begins inside it."""
    plan = prepare(TOOLS, Choice("auto"), _chatml(qwen_tok))
    assert plan.family.name == "generic"
    g = Grammar.compile(plan.constraint, qwen_tok)
    ids = qwen_tok.encode('Sure {"tool_calls": [', add_bos=False)
    assert all(qwen_tok.token_bytes(i) != b"{" for i in ids)  # no token starts at the trigger
    m = g.matcher()
    feed(m, ids)
    assert m.triggered
    _, calls = plan.parse(finish(qwen_tok, m, list(ids)))
    assert calls


def _chatml(tok):
    """The same vocabulary with a template that has no tools (so `prepare` picks the generic form)."""
    clone = Tokenizer.__new__(Tokenizer)
    clone.__dict__ = dict(tok.__dict__, chat_template=None)
    return clone


def test_a_trigger_whose_token_runs_off_the_grammar_ends_the_reply(qwen_tok):
    """'["' ends the trigger and goes on with '"' where the grammar wants '{': the reply ends."""
    plan = prepare(TOOLS, Choice("auto"), _chatml(qwen_tok))
    m = Grammar.compile(plan.constraint, qwen_tok).matcher()
    (bracket_quote,) = qwen_tok.encode('["', add_bos=False)
    for t in [*qwen_tok.encode('{"tool_calls": ', add_bos=False), bracket_quote]:
        m.accept(t)
    assert set(np.flatnonzero(m.allowed())) == set(qwen_tok.stop_ids)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_streamed_reply_gives_the_whole_replys_content_and_calls(family):
    f = FAMILIES[family]
    calls = [Call("get_time", {"zone": "Europe/Paris"})]
    if family != "llama3":
        calls.append(Call("get_weather", {"city": "Lima", "unit": "celsius", "where": {"country": "Peru"}}))
    text = "Checking. " + f.text(calls)
    for step in (1, 2, 3, 7):
        s = ToolStream(f)
        sent = "".join(s.feed(text[i : i + step]) for i in range(0, len(text), step))
        rest, got = s.finish()
        assert sent + rest == "Checking. " and got == calls
        assert f.trigger not in sent


def test_a_stream_without_calls_gives_all_its_text():
    s = ToolStream(FAMILIES["hermes"])
    parts = ["I use <tool", "_ca", "se> tags? ", "no."]
    sent = "".join(s.feed(p) for p in parts)
    rest, calls = s.finish()
    assert sent + rest == "".join(parts) and calls == []


def test_mistrals_control_token_trigger_starts_the_grammar(vocabularies, tmp_path):
    """[TOOL_CALLS] is one control token: text cannot spell it, the grammar opens with its id."""
    path = tmp_path / "mistral.gguf"
    script("make_model").write_gguf(script("make_model").RECIPES["tiny-mistral"], path, vocab_only=True)
    tok = Tokenizer.from_gguf(path)
    plan = prepare(TOOLS, Choice("auto"), tok)
    (trigger,) = tok.encode("[TOOL_CALLS]", special=True, add_bos=False)
    assert plan.family.name == "mistral" and f"<[{trigger}]>" in plan.constraint.text
    m = Grammar.compile(plan.constraint, tok).matcher()
    feed(m, tok.encode("Sure.", add_bos=False))
    assert m.allowed().all() and not m.triggered
    feed(m, [trigger])
    assert m.triggered
    content, calls = plan.parse(finish(tok, m, [*tok.encode("Sure.", add_bos=False), trigger]))
    assert calls and content.strip() == "Sure."
    for c in calls:
        jsonschema.validate(c.arguments, SCHEMAS[c.name])
