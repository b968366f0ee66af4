"""Structured output: llguidance grammars over a model's own vocabulary. Random logits stand for
the model: whatever they favour, the masked sampler's text must match the grammar."""

import json

import numpy as np
import pytest

from localkv.errors import LocalkvError
from localkv.grammar import Grammar, check
from localkv.model.tokenizer import Tokenizer
from localkv.sampling import Constraint, Sampler, SamplingParams
from resources import script
from tiny_model import write_gguf

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    """The tiny test model's vocabulary: three specials, 256 bytes, two merges."""
    return Tokenizer.from_gguf(write_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf"))


def sample(tok: Tokenizer, grammar: Grammar, seed: int, max_tokens: int = 400, temperature: float = 1.0) -> str:
    rng = np.random.default_rng(seed)
    s = Sampler(SamplingParams(temperature=temperature, top_k=0, top_p=1.0, seed=seed), grammar.matcher())
    ids = []
    for _ in range(max_tokens):
        t = s(rng.standard_normal(tok.vocab_size).astype(np.float32) * 3)
        if t in tok.stop_ids:
            return tok.decode(ids)
        ids.append(t)
    raise AssertionError(f"no end token within {max_tokens} tokens: {tok.decode(ids)!r}")


def valid(obj) -> bool:
    return (
        set(obj) == {"name", "age", "tags"}
        and isinstance(obj["name"], str)
        and len(obj["name"]) <= 12
        and type(obj["age"]) is int
        and 0 <= obj["age"] <= 150
        and len(obj["tags"]) <= 3
        and set(obj["tags"]) <= {"a", "b"}
    )


@pytest.mark.parametrize("seed", range(8))
def test_schema_constrained_text_parses_and_satisfies_the_schema(byte_tok, seed):
    g = Grammar.compile(Constraint("json_schema", json.dumps(SCHEMA)), byte_tok)
    assert valid(json.loads(sample(byte_tok, g, seed)))


def test_format_json_gives_an_object(byte_tok):
    g = Grammar.compile(Constraint("json"), byte_tok)
    for seed in range(4):  # random logits write long values: a colder draw ends sooner
        assert isinstance(json.loads(sample(byte_tok, g, seed, max_tokens=2000, temperature=0.5)), dict)


@pytest.mark.parametrize("text", ['start: "yes" | "no"\n', 'root ::= "yes" | "no"\n'], ids=["lark", "gbnf"])
def test_lark_and_gbnf_grammars(byte_tok, text):
    g = Grammar.compile(Constraint("grammar", text), byte_tok)
    assert {sample(byte_tok, g, seed) for seed in range(12)} == {"yes", "no"}


def test_special_tokens_are_never_text_and_end_tokens_come_when_the_grammar_accepts(byte_tok):
    m = Grammar.compile(Constraint("json_schema", '{"type": "string"}'), byte_tok).matcher()
    m.accept(byte_tok.encode('"', special=False)[0])
    allowed = m.allowed()
    # inside a string any text goes, yet <|endoftext|>, <|im_start|>, <|im_end|> are not text
    assert allowed[byte_tok.encode("<", special=False)[0]] and not allowed[[0, 1, 2]].any()
    m.accept(byte_tok.encode('"', special=False)[0])
    assert m.accepting
    assert set(np.flatnonzero(m.allowed())) == set(byte_tok.stop_ids)


def test_every_branch_has_its_own_matcher(byte_tok):
    g = Grammar.compile(Constraint("grammar", 'start: "ab" | "ba"\n'), byte_tok)
    a, b = g.matcher(), g.matcher()
    a.accept(byte_tok.encode("a", special=False)[0])
    assert b.allowed()[byte_tok.encode("b", special=False)[0]]  # b did not move with a
    assert not a.allowed()[byte_tok.encode("a", special=False)[0]]


@pytest.mark.parametrize(
    "c,needle",
    [
        (Constraint("json_schema", "{not json", "s.json"), "invalid JSON schema in s.json: not JSON"),
        (Constraint("json_schema", "[1]"), "expected a JSON object"),
        (Constraint("json_schema", '{"type": "frob"}'), "invalid json schema"),
        (Constraint("grammar", "root ::= (", "g.gbnf"), "invalid grammar in g.gbnf"),
        (Constraint("grammar", "start: undefined_rule\n"), "invalid grammar"),
        (Constraint("grammar", "  "), "empty grammar"),
        (Constraint("yaml", "a: 1"), "unknown output format"),
    ],
)
def test_bad_constraints_are_one_line_errors_before_any_model_loads(c, needle):
    with pytest.raises(LocalkvError) as e:
        check(c)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_ignore_eos_is_refused_with_a_constraint():
    with pytest.raises(LocalkvError, match="ignore-eos"):
        SamplingParams(ignore_eos=True, constraint=Constraint("json")).validate()


# ------------------------------------------------------------------ real vocabularies


@pytest.mark.parametrize("recipe", ["tiny-llama2", "tiny-llama3", "tiny-qwen2"])
def test_schema_on_real_vocabularies(recipe, vocabularies, tmp_path):
    """SentencePiece (its encoder puts a space before text: llguidance gets greedy tokens then)
    and large byte-level BPE vocabularies."""
    path = tmp_path / "vocab.gguf"
    try:
        script("make_model").write_gguf(script("make_model").RECIPES[recipe], path, vocab_only=True)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    tok = Tokenizer.from_gguf(path)
    g = Grammar.compile(Constraint("json_schema", json.dumps(SCHEMA)), tok)
    for seed in range(3):
        assert valid(json.loads(sample(tok, g, seed)))
