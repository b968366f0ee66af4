"""Structured output: llguidance grammars over a model's own vocabulary. Random logits stand for
the model: whatever they favour, the masked sampler's text must match the grammar."""

import copy
import json

import numpy as np
import pytest

from localkv.errors import LocalkvError
from localkv.grammar import Grammar, check
from localkv.json_numbers import SAFE_INTEGER, bounded_numbers
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


# ------------------------------------------------------------------ numbers end by grammar

NUMBERS = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "x": {"type": "number"}},
    "required": ["n", "x"],
}
D16 = "1234567890123456"  # 16 digits, under 2^53 - 1 = 9007199254740991


def walked(tok: Tokenizer, c: Constraint, text: str):
    """A matcher that took text."""
    m = Grammar.compile(c, tok).matcher()
    for t in tok.encode(text, special=False):
        m.accept(t)
    return m


def digits_after(tok: Tokenizer, c: Constraint, text: str, chars: str = "0123456789") -> bool:
    """Whether the grammar lets one of chars (a digit) follow text."""
    allowed = walked(tok, c, text).allowed()
    return any(allowed[tok.encode(d, special=False)[0]] for d in chars)


def schema(s: dict) -> Constraint:
    return Constraint("json_schema", json.dumps(s))


def obj(value: dict) -> dict:
    return {"type": "object", "properties": {"a": value}, "required": ["a"]}


# where a number may sit, and the text before it
PLACES = {
    "integer": (schema(NUMBERS), '{"n": '),
    "negative": (schema(NUMBERS), '{"n": -'),
    "number": (schema(NUMBERS), '{"n": 1, "x": '),
    "negative-number": (schema(NUMBERS), '{"n": 1, "x": -'),
    "items": (schema({"type": "array", "items": {"type": "integer"}}), "[1, "),
    "prefixItems": (schema({"type": "array", "prefixItems": [{"type": "number"}]}), "["),
    "nested": (schema(obj({"type": "object", "properties": {"b": {"type": "integer"}}})), '{"a": {"b": '),
    "anyOf": (schema(obj({"anyOf": [{"type": "string"}, {"type": "integer"}]})), '{"a": '),
    "oneOf": (schema(obj({"oneOf": [{"type": "string"}, {"type": "number"}]})), '{"a": '),
    "allOf": (schema({"allOf": [obj({"type": "integer"})]}), '{"a": '),
    "$defs": (schema(obj({"$ref": "#/$defs/n"}) | {"$defs": {"n": {"type": "integer"}}}), '{"a": '),
    "definitions": (schema(obj({"$ref": "#/definitions/n"}) | {"definitions": {"n": {"type": "number"}}}), '{"a": '),
    "additionalProperties": (schema({"type": "object", "additionalProperties": {"type": "number"}}), '{"k": '),
    "type-list": (schema(obj({"type": ["integer", "null"]})), '{"a": '),
    "minimum-0": (schema(obj({"type": "integer", "minimum": 0})), '{"a": '),  # one side the user's, one ours
    "exclusiveMaximum-0": (schema(obj({"type": "number", "exclusiveMaximum": 0})), '{"a": -'),
    # open places: where the schema takes any value
    "other-property": (schema(NUMBERS), '{"n": 1, "x": 2, "k": [{"j": '),
    "any-property": (schema(obj({"description": "anything"})), '{"a": ['),
    "true-items": (schema({"type": "array", "items": True}), "["),
    "no-items": (schema({"type": "array", "prefixItems": [{"type": "string"}]}), '["s", '),
    "no-type": (schema({"properties": {"a": {"type": "string"}}}), ""),  # a number is valid here
    "no-type-other": (schema({"properties": {"a": {"type": "string"}}}), '{"b": '),
    "json": (Constraint("json"), '{"k": [{"j": '),  # --format json: any depth
    # allOf of two open objects: llguidance cannot intersect their open places, the fields stay bounded
    "allOf-open": (schema({"allOf": [obj({"type": "integer"}), {"type": "object"}]}), '{"a": '),
}


@pytest.mark.parametrize("place", PLACES)
def test_an_unbounded_number_ends_after_16_digits(byte_tok, place):
    c, before = PLACES[place]
    assert digits_after(byte_tok, c, before + D16[:15])
    assert not digits_after(byte_tok, c, before + D16)  # only what closes the number


def test_a_number_has_at_most_16_significant_digits_and_no_exponent(byte_tok):
    """A whole number of up to 16 digits, or one under 10^8 with up to 8 decimals."""
    c, x = schema(NUMBERS), '{"n": 1, "x": '
    assert digits_after(byte_tok, c, x + D16[:8] + ".1234567")
    assert not digits_after(byte_tok, c, x + D16[:8] + ".12345678")
    assert digits_after(byte_tok, c, x + D16[:8], ".") and not digits_after(byte_tok, c, x + D16[:9], ".")
    assert digits_after(byte_tok, c, x + "-" + D16[:8], ".") and not digits_after(byte_tok, c, x + "-" + D16[:9], ".")
    assert not digits_after(byte_tok, c, x + "1.5", "eE") and not digits_after(byte_tok, c, x + "15", "eE")


def test_the_bound_is_the_largest_integer_a_double_holds_exactly(byte_tok):
    c, top = schema(obj({"type": "integer"})), str(SAFE_INTEGER)  # 2^53 - 1 = 9007199254740991
    assert digits_after(byte_tok, c, '{"a": ' + top[:-1], top[-1]) and SAFE_INTEGER == 2**53 - 1
    assert not digits_after(byte_tok, c, '{"a": ' + top[:-1], "2")  # 2^53: a double rounds 2^53 + 1


@pytest.mark.parametrize(
    "value,before,digits",
    [
        ({"type": "integer", "maximum": 10**18}, '{"a": ', 18),
        ({"type": "integer", "minimum": -(10**18)}, '{"a": -', 18),
        ({"type": "number", "maximum": 10**18}, '{"a": ', 18),
        # llguidance's integer bounds are 64-bit: 10^20 stands for 2^63 - 1, 19 digits
        ({"type": "integer", "maximum": 10**20}, '{"a": ', 19),
    ],
)
def test_a_wider_bound_of_the_schemas_own_is_kept(byte_tok, value, before, digits):
    c = schema(obj(value))
    assert digits_after(byte_tok, c, before + "1" * (digits - 1))
    assert not digits_after(byte_tok, c, before + "1" * digits)


def test_a_bound_beyond_ours_leaves_the_other_side_open(byte_tok):
    """minimum 10^17 with our maximum would be no number at all: the schema's side wins."""
    assert digits_after(byte_tok, schema(obj({"type": "integer", "minimum": 10**17})), '{"a": ' + "1" * 30)


def test_a_multipleof_that_cannot_join_the_decimals_cap_is_kept_exact(byte_tok):
    """llguidance joins two multipleOf by their least common multiple in 32 bits: 99.5 and the
    cap's 1e-8 would overflow into a grammar that takes no multiple of 99.5 at all."""
    c = schema(obj({"allOf": [{"type": "number", "multipleOf": 99.5}, {"type": "number"}]}))
    assert walked(byte_tok, c, '{"a": 199}').accepting and walked(byte_tok, c, '{"a": -99.5}').accepting
    assert digits_after(byte_tok, c, '{"a": 199' + "0" * 12) and not digits_after(byte_tok, c, '{"a": 199' + "0" * 13)


def test_the_callers_schema_is_not_changed(byte_tok):
    s = obj({"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": ["number", "null"]}]}})
    s["$defs"] = {"n": {"type": "integer", "minimum": 0}}
    before = copy.deepcopy(s)
    assert bounded_numbers(s) != s and s == before


@pytest.mark.parametrize("seed", range(6))
def test_random_logits_end_a_schemas_numbers(byte_tok, seed):
    """Digits are 10 of the 12 bytes a number may take next: without an end in the grammar,
    random logits write numbers far longer than this."""
    g = Grammar.compile(schema(NUMBERS | {"additionalProperties": False}), byte_tok)
    reply = json.loads(sample(byte_tok, g, seed, max_tokens=70))
    assert type(reply["n"]) is int and abs(reply["n"]) <= SAFE_INTEGER and abs(reply["x"]) < 2**53


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


def test_a_numbers_own_bounds_beyond_10_to_the_8_leave_whole_numbers(byte_tok):
    c = schema(obj({"type": "number", "minimum": 10**9}))
    assert digits_after(byte_tok, c, '{"a": 1' + "0" * 14) and not digits_after(byte_tok, c, '{"a": 1' + "0" * 9, ".")
