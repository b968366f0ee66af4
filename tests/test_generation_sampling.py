"""What Generation does with the sampling options of issue 19, on a tiny random-weight model:
stop strings across token boundaries, penalties over the branch's history, log-probabilities,
schema-constrained forks, the context (--ctx) and prefill progress."""

import json

import pytest

from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.errors import ContextOverflow, PoolExhausted
from localkv.generation import Generation
from localkv.sampling import Constraint, SamplingParams
from tiny_model import write_gguf

GREEDY = dict(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gen") / "tiny.gguf", ctx=512)


@pytest.fixture(scope="module")
def eng(tiny):
    return Engine(EngineConfig(model=str(tiny), block_size=8, kv_mem="8MiB", prefix_cache=False))


def prompt(eng, text="tell me a story about the sea"):
    return eng.tokenizer.encode(text)


def test_a_stop_string_across_tokens_ends_the_reply_before_it(eng):
    free = Generation(eng, prompt(eng), SamplingParams(**GREEDY)).run()
    text = free.text
    # a stop string of 3 characters from the middle of the reply: 3 byte-level tokens at least
    at = next(i for i in range(5, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    stop = text[at : at + 3]
    gen = Generation(eng, prompt(eng), SamplingParams(**GREEDY, stop=("zzzz-never", stop)))
    pieces = [p.text for p in gen]
    r = gen.result
    first = text.index(stop)
    assert r.text == "".join(pieces) == text[:first] and stop not in "".join(pieces)
    assert r.finish_reason == "stop" and stop in r.stop_detail
    assert len(r.tokens) < len(free.tokens)  # it stopped early; the stop text's tokens were generated
    assert eng.pool.usage()["used"] == 0  # the stopped branch's blocks, the stop text's K/V too, are free


def test_text_held_back_for_a_stop_string_that_never_completes_is_released(eng):
    free = Generation(eng, prompt(eng), SamplingParams(**GREEDY)).run()
    stop = free.text[-2:] + "\x00never"  # its start is the reply's tail: held back, then released at the end
    r = Generation(eng, prompt(eng), SamplingParams(**GREEDY, stop=(stop,))).run()
    assert r.text == free.text and r.finish_reason == "length"


def test_presence_penalty_sees_the_prompt_and_the_reply(eng):
    ids = prompt(eng)
    r = Generation(
        eng, ids, SamplingParams(**GREEDY | {"max_tokens": 30}, presence_penalty=1e6, repeat_last_n=-1)
    ).run()
    # a huge presence penalty: no token of the prompt, and none twice
    assert len(set(r.tokens)) == len(r.tokens) and not set(r.tokens) & set(ids)


def test_logprobs_one_per_token_of_every_branch(eng):
    r = Generation(eng, prompt(eng), SamplingParams(temperature=1.0, seed=3, max_tokens=12, logprobs=4), n=3).run()
    for b in r.branches:
        assert [lp.token for lp in b.logprobs] == b.tokens
        assert all(len(lp.top) == 4 and lp.top[0][1] >= lp.logprob for lp in b.logprobs)


SCHEMA = {
    "type": "object",
    "properties": {"word": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["word", "n"],
    "additionalProperties": False,
}


def test_every_branch_of_a_constrained_fork_parses(eng):
    params = SamplingParams(
        temperature=8.0, seed=5, max_tokens=200, constraint=Constraint("json_schema", json.dumps(SCHEMA))
    )
    r = Generation(eng, prompt(eng), params, n=4).run()
    replies = [json.loads(b.text) for b in r.branches]
    assert all(set(x) == {"word", "n"} and len(x["word"]) <= 6 and 0 <= x["n"] <= 99 for x in replies)
    assert all(b.finish_reason == "stop" for b in r.branches) and len({b.text for b in r.branches}) > 1


def test_ctx_limits_a_sequence(tiny):
    e = Engine(EngineConfig(model=str(tiny), block_size=8, kv_mem="8MiB", prefix_cache=False, ctx=40))
    assert e.ctx == 40
    r = Generation(e, prompt(e), SamplingParams(**GREEDY | {"max_tokens": 100})).run()
    assert r.finish_reason == "context" and r.prompt_tokens + len(r.tokens) == 40
    with pytest.raises(ContextOverflow, match=r"the context \(--ctx\) holds 40"):
        Generation(e, list(range(3, 43)), SamplingParams(**GREEDY))


def test_ctx_is_checked_against_the_model_and_the_pool(tiny):
    with pytest.raises(ContextOverflow, match="more than the model's context of 512"):
        Engine(EngineConfig(model=str(tiny), ctx=513, prefix_cache=False))
    with pytest.raises(PoolExhausted, match=r"--ctx 512 needs 64 KV blocks .* the pool holds \d+ .*raise --kv-mem"):
        Engine(EngineConfig(model=str(tiny), ctx=512, block_size=8, kv_mem="64KiB", prefix_cache=False))
    assert Engine(EngineConfig(model=str(tiny), prefix_cache=False)).ctx == 512  # default: the model's


def test_prefill_progress_is_reported_per_chunk_then_done(tiny):
    e = Engine(EngineConfig(model=str(tiny), block_size=8, kv_mem="8MiB", prefix_cache=False, prefill_chunk=16))
    seen = []
    ids = prompt(e, "a long prompt " * 8)
    Generation(e, ids, SamplingParams(**GREEDY | {"max_tokens": 3}), on_progress=seen.append).run()
    done = [p.done for p in seen]
    assert done == sorted(done) and done[-1] == len(ids) and len(seen) == -(-len(ids) // 16)
    assert seen[-1].finished and not any(p.finished for p in seen[:-1]) and all(p.total == len(ids) for p in seen)
