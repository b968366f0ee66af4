"""A chat's next prompt warmed before it is asked (localkv/next_turn.py), on the tiny Qwen3 and
R1-distill models made to think: their templates drop a finished turn's thinking, so without
the warm the next turn's prompt leaves the cache right after the assistant header; with it, the
next turn finds every whole block up to the new question, and its reply is the same."""

import pytest
from thinking_models import scripted, write

from localkv import next_turn, reasoning
from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.generation import Generation
from localkv.sampling import SamplingParams
from localkv.toolcalls import Call, prepare, read_tools

SYSTEM = "You answer in one word. " * 12
THOUGHT = "The question is about France, whose capital city has been Paris for a very long time."
ANSWER = "Paris, the capital, on the Seine, as every atlas and every schoolbook in the country has said for centuries."
REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
FIRST = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Capital of France?"}]
SECOND = "And of Spain?"
PARAMS = SamplingParams(temperature=0, max_tokens=80)


def engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), disk_cache=False, kv_mem="32MiB", ctx=1024, threads=2, **kw))


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-r1-distill"])
def model(request, vocabularies, tmp_path_factory):
    return write(tmp_path_factory.mktemp("next-turn"), request.param)


def script(eng: Engine, monkeypatch):
    """Make the model think REPLY (an R1 distill's prompt opens the thinking itself)."""
    inside = reasoning.family(eng.tokenizer.chat_template).name == "deepseek-r1"
    scripted(monkeypatch, eng.tokenizer, REPLY.removeprefix("<think>\n") if inside else REPLY)


def reply(eng: Engine, messages: list[dict]) -> Generation:
    text, plan = reasoning.chat(eng.tokenizer, messages, PARAMS)
    g = Generation(eng, eng.tokenizer.encode(text), PARAMS, reasoning=plan)
    g.run()
    return g


def two_turns(eng: Engine, monkeypatch, warm: bool) -> tuple[Generation, Generation, list[int]]:
    """Turn 1, the warm (or not), turn 2: both replies and the warmed prefix."""
    script(eng, monkeypatch)
    first = reply(eng, FIRST)
    prefix = next_turn.prefix_ids(eng.tokenizer, FIRST, first.result.text, PARAMS)
    if warm:
        assert next_turn.warm(eng, prefix) > 0
    history = [*FIRST, {"role": "assistant", "content": first.result.text}, {"role": "user", "content": SECOND}]
    return first, reply(eng, history), prefix


def test_the_prefix_is_the_next_prompt_up_to_the_new_question_without_the_thinking(model, monkeypatch):
    eng = engine(model)
    first, second, prefix = two_turns(eng, monkeypatch, warm=False)
    tok = eng.tokenizer
    assert (first.result.reasoning, first.result.text) == (THOUGHT, ANSWER)
    assert second.prompt[: len(prefix)] == prefix
    shown = tok.decode(prefix)
    assert first.result.text in shown and THOUGHT not in shown
    rest = tok.decode(second.prompt[len(prefix) :])
    assert rest.startswith(SECOND[:3]) or rest.lstrip("\n").startswith(SECOND[:3])  # nothing but the question after it


def test_a_warmed_turn_is_a_hit_up_to_the_new_question(model, monkeypatch):
    bs = engine(model).block_size
    cold = two_turns(engine(model), monkeypatch, warm=False)[1].result
    first, second, prefix = two_turns(engine(model), monkeypatch, warm=True)
    warmed = second.result
    assert warmed.cached_tokens == len(prefix) // bs * bs
    assert cold.cached_tokens < warmed.cached_tokens - bs  # the answer's blocks were missed before
    assert (warmed.text, warmed.reasoning, warmed.tokens) == (cold.text, cold.reasoning, cold.tokens)


def test_a_warm_asked_to_stop_keeps_the_blocks_it_computed(model, monkeypatch):
    eng = engine(model, prefill_chunk=16)
    script(eng, monkeypatch)
    first = reply(eng, FIRST)
    prefix = next_turn.prefix_ids(eng.tokenizer, FIRST, first.result.text, PARAMS)

    def cached() -> int:
        seq, n = eng.open_sequence([*prefix, prefix[-1]])
        eng.free(seq)
        return n

    before, asked = cached(), iter([False, True])
    assert next_turn.warm(eng, prefix, stop=lambda: next(asked)) == 16  # one chunk, then stopped
    assert cached() == before + 16
    assert next_turn.warm(eng, prefix) > 0  # the rest, later
    assert cached() == len(prefix) // 16 * 16
    assert next_turn.warm(eng, prefix) == 0  # nothing left to compute


def test_a_reply_that_calls_a_tool_warms_nothing(model):
    eng = engine(model)
    offered = read_tools([{"type": "function", "function": {"name": "capital", "parameters": {}}}])
    tools = prepare(offered, None, eng.tokenizer)
    call = tools.family.text([Call("capital", {})])
    assert tools.parse(call)[1]
    assert next_turn.prefix_ids(eng.tokenizer, FIRST, call, PARAMS, tools=tools) == []
    assert next_turn.prefix_ids(eng.tokenizer, FIRST, "Paris.", PARAMS, tools=tools)
