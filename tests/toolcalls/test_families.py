"""Each family's template on the generated tiny models' real vocabularies and chat templates:
the prompt lists the tools, and whatever random logits favour, the constrained reply parses into
calls whose arguments match their function's schema (enums, nested objects, arrays, required)."""

import jsonschema
import pytest
from test_grammar import sample

from localkv.grammar import Grammar
from localkv.model.tokenizer import Tokenizer
from localkv.toolcalls import Choice, prepare, read_tools
from resources import script

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}, "lon": {"enum": [0, 1.5]}},
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
        "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["city", "unit", "where", "days"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 30}},
    "required": ["query"],
    "additionalProperties": False,
}
TOOLS = read_tools(
    [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
        {"type": "function", "function": {"name": "search", "description": "Search", "parameters": SEARCH}},
    ]
)
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}

# recipe -> the family its template speaks (generic: a template without tools)
RECIPES = {
    "tiny-qwen2": "hermes",
    "tiny-qwen3": "hermes",
    "tiny-mistral": "mistral",
    "tiny-llama3": "generic",
    "tiny-phi3": "generic",
    "tiny-gemma2": "generic",
}


@pytest.fixture(scope="module", params=sorted(RECIPES))
def family_tok(request, vocabularies, tmp_path_factory):
    path = tmp_path_factory.mktemp("v") / "vocab.gguf"
    try:
        script("make_model").write_gguf(script("make_model").RECIPES[request.param], path, vocab_only=True)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return request.param, Tokenizer.from_gguf(path)


def draw(tok: Tokenizer, grammar: Grammar, seed: int) -> str:
    """A reply drawn from random logits under the grammar (test_grammar's sampler, longer)."""
    return sample(tok, grammar, seed, max_tokens=600)


def test_each_family_prompts_with_the_tools_and_its_calls_validate(family_tok):
    recipe, tok = family_tok
    plan = prepare(TOOLS, Choice("required", parallel=True), tok)
    assert plan.family.name == RECIPES[recipe]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    if recipe == "tiny-gemma2":  # Gemma 2's template refuses a system turn: it cannot take the generic block
        with pytest.raises(Exception, match="cannot take tools"):
            plan.prompt(tok, messages)
        return
    text = plan.prompt(tok, messages)
    assert "get_weather" in text and "fahrenheit" in text
    g = Grammar.compile(plan.constraint, tok)
    for seed in range(3):
        reply = draw(tok, g, seed)
        content, calls = plan.parse(reply)
        assert calls, reply
        for c in calls:
            jsonschema.validate(c.arguments, SCHEMAS[c.name])
        assert plan.parse(plan.family.text(calls))[1] == calls  # a history re-renders the calls it read


def test_a_named_choice_calls_that_function_only(family_tok):
    recipe, tok = family_tok
    plan = prepare(TOOLS, Choice("named", "search", parallel=False), tok)
    g = Grammar.compile(plan.constraint, tok)
    for seed in range(3):
        _, calls = plan.parse(draw(tok, g, seed))
        assert [c.name for c in calls] == ["search"]
        jsonschema.validate(calls[0].arguments, SEARCH)


def test_a_history_with_calls_and_results_renders_in_the_family_form(family_tok):
    recipe, tok = family_tok
    if recipe == "tiny-gemma2":
        pytest.skip("Gemma 2's template takes no system turn")
    plan = prepare(TOOLS, Choice("auto"), tok)
    call = {"id": "call_abc", "name": "search", "arguments": {"query": "paris"}}
    messages = [
        {"role": "user", "content": "Find Paris."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "Paris is in France."},
    ]
    text = plan.prompt(tok, messages)
    assert "Paris is in France." in text and '"query": "paris"' in text


# Llama 3.1's tool format in a template cut to what matters (the tiny llama3 vocabulary's has no tools)
LLAMA31 = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}<|eom_id|>{% else %}{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


def test_llama3_json_calls_on_the_llama3_vocabulary(vocabularies, tmp_path):
    path = tmp_path / "vocab.gguf"
    script("make_model").write_gguf(script("make_model").RECIPES["tiny-llama3"], path, vocab_only=True)
    tok = Tokenizer.from_gguf(path)
    tok.chat_template = LLAMA31
    tok.__dict__.pop("_template", None)  # compiled on first use
    plan = prepare(TOOLS, Choice("required"), tok)
    assert plan.family.name == "llama3" and plan.native
    call = {"id": "c1", "name": "search", "arguments": {"query": "x"}}
    history = [
        {"role": "user", "content": "Find x."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "x is y"},
    ]
    text = plan.prompt(tok, history)
    assert '"get_weather"' in text and '{"name": "search", "parameters": {"query": "x"}}' in text
    g = Grammar.compile(plan.constraint, tok)
    for seed in range(3):
        _, calls = plan.parse(draw(tok, g, seed))
        assert len(calls) == 1
        jsonschema.validate(calls[0].arguments, SCHEMAS[calls[0].name])
