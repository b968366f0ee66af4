"""A Generation's events (what the server streams) add up to its Result: per choice, the Deltas'
text, token ids and log-probabilities are the branch's, one Finished ends it with its reason,
and the usages sum to the request's. Also ServeOptions' one check of the server's limits."""

import pytest

from localkv.config import EngineConfig, ServeOptions
from localkv.engine import Engine
from localkv.errors import LocalkvError
from localkv.events import Delta, Finished, Usage
from localkv.generation import Generation
from localkv.sampling import SamplingParams
from localkv.scheduler import Scheduler
from localkv.serve.runner import Runner
from tiny_model import write_gguf


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    path = write_gguf(tmp_path_factory.mktemp("events") / "tiny.gguf", ctx=512)
    return Engine(EngineConfig(model=str(path), block_size=8, kv_mem="8MiB", prefix_cache=False))


def run_shared(eng, gen: Generation) -> list:
    """Run gen under a shared scheduler, as the server does, and take all its events."""
    sched = Scheduler(eng, max_seqs=gen.n)
    sched.add(gen)
    while not gen.done:
        sched.step()
    return list(gen.events())


def test_the_events_add_up_to_the_result(eng):
    free = Generation(eng, eng.tokenizer.encode("a story"), SamplingParams(temperature=0, max_tokens=30)).run()
    stop = next(free.text[i : i + 2] for i in range(4, len(free.text) - 2) if "\ufffd" not in free.text[i : i + 2])
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=30, logprobs=2, stop=(stop,), ignore_eos=True)
    gen = Generation(eng, eng.tokenizer.encode("a story"), params, n=3, queued=True, first_choice=6)
    events = run_shared(eng, gen)
    r = gen.result
    ends = [e for e in events if isinstance(e, Finished)]
    assert [e.choice for e in ends] == [6, 7, 8]
    for b in r.branches:
        mine = [e for e in events if e.choice == 6 + b.index]
        assert mine[-1] is ends[b.index]  # a choice's Finished is its last event
        deltas = [e for e in mine if isinstance(e, Delta)]
        assert "".join(e.text for e in deltas) == b.text
        assert [t for e in deltas for t in e.token_ids] == b.tokens
        assert [lp for e in deltas for lp in e.logprobs] == b.logprobs
        assert all(e.text for e in deltas[:-1])  # only the last may carry tokens without text
        end = ends[b.index]
        assert (end.reason, end.detail, end.usage.completion_tokens) == (b.finish_reason, b.stop_detail, len(b.tokens))
    assert any(b.finish_reason == "stop" for b in r.branches)  # a stop string held text back on the way
    total = sum((e.usage for e in ends), Usage())
    assert total == Usage(r.prompt_tokens, r.cached_tokens, r.completion_tokens)
    assert ends[0].ttft_s == r.ttft_s > 0 and ends[1].ttft_s == ends[2].ttft_s == 0
    assert eng.pool.usage()["used"] == 0


def test_a_cancelled_generation_still_ends_with_finished(eng):
    gen = Generation(eng, eng.tokenizer.encode("never run"), SamplingParams(max_tokens=5), queued=True)
    gen.cancel("cancelled")
    assert list(gen.events()) == [Finished(0, "cancelled", "", Usage(gen.result.prompt_tokens, 0, 0))]


@pytest.mark.parametrize(
    "bad,message",
    [
        (dict(port=70000), "invalid --port 70000: must be in 0..65535"),
        (dict(max_seqs=0), "invalid --max-seqs 0: must be >= 1"),
        (dict(max_queue=-1), "invalid --max-queue -1: must be >= 0"),
        (dict(batch_tokens=0), "invalid --batch-tokens 0: must be >= 1"),
    ],
)
def test_serve_options_name_the_bad_flag(bad, message):
    with pytest.raises(LocalkvError) as e:
        ServeOptions(**bad).validate()
    assert str(e.value) == message
    with pytest.raises(LocalkvError, match=message):  # the runner takes no limit validate() refuses
        Runner(EngineConfig(model="unused.gguf"), ServeOptions(**bad))
    assert ServeOptions().validate() == ServeOptions()
