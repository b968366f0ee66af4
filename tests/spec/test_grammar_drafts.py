"""Constrained replies draft too: the tokens a grammar forces (a schema's keys and punctuation)
are a draft of their own, and a prompt-lookup draft is cut at its first token the grammar
refuses, before the verify pass (GrammarMatcher.guide, Generation.draft)."""

import json

from test_one_answer import models  # noqa: F401 (a fixture)
from test_speculation import engine, run, tokens

from localkv.grammar import Grammar
from localkv.model.tokenizer import Tokenizer
from localkv.sampling import Constraint, SamplingParams

KEYS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett"]
SCHEMA = {  # ten keys that share no text: prompt lookup alone finds little to draft
    "type": "object",
    "properties": {k: {"type": "boolean"} for k in KEYS},
    "required": KEYS,
    "additionalProperties": False,
}
PARAMS = SamplingParams(temperature=0, max_tokens=200, constraint=Constraint("json_schema", json.dumps(SCHEMA)))


def test_forced_text_is_drafted_and_a_refused_draft_is_cut(models):  # noqa: F811
    tok = Tokenizer.from_gguf(models("llama-Q4_1").path)
    m = Grammar.compile(PARAMS.constraint, tok).matcher()
    forced = m.guide([], 64)
    assert forced, "an object's opening and its first key are forced"
    for t in forced:
        m.accept(t)
    assert m.guide([], 64) == [], "true or false: nothing is forced"
    ids = tok.encode(" true,", special=False, add_bos=False) + tok.encode("}", special=False, add_bos=False)
    got = m.guide(ids, 64)
    assert got == ids[:-1], "cut at the first refused token: 9 keys are still required"


def test_a_json_reply_drafts_its_keys_and_keeps_its_text(models):  # noqa: F811
    path = models("llama-Q4_1")
    want = run(engine(path), params=PARAMS)
    got = run(engine(path, spec="ngram"), params=PARAMS)
    assert tokens(got) == tokens(want)
    json.loads(got.text)
    s = got.speculation()
    keys = sum(len(k) for k in KEYS)  # bytes of the keys: their tokens are at least half as many
    assert s["accepted"] >= keys // 2 and s["tokens_per_pass"] > 2, s
