"""cli/render.py: what `run` and `fork` print for a result, exactly, on a fake engine (the CLI
tests run the real one; these pin the layout and where the saved ids go)."""

import json
from types import SimpleNamespace as NS

from localkv.cli.render import Saved, dumps, fork_json, fork_text, fork_verbose, reply_json, reply_verbose
from localkv.generation import Result


def _engine(policy="none", prefix_caching=True):
    return NS(
        block_size=16,
        ctx=64,
        model_config=NS(name="tiny"),
        pool=NS(num_blocks=100),
        stats=NS(cow_copies=1, evictions=2, offloads=0, recalls=0, events=[]),
        policy=NS(config=NS(policy=policy, budget=32)),
        prefix_caching=prefix_caching,
        loaded=NS(cache_hit=True),
        kv_dtype="q8_0",
        kv_bytes_per_token=11968,
    )


def _branch(text, n, reason="length"):
    return NS(
        text=text,
        tokens=list(range(n)),
        finish_reason=reason,
        peak_active_tokens=20 + n,
        logprobs=[],
        spec=None,
        passes=n,
        reasoning="",
        reasoning_tokens=0,
        gate=None,
    )


def _result(*branches):
    return Result(
        list(branches), prompt_tokens=20, cached_tokens=16, prompt_s=0.5, eval_s=1.0, peak_blocks=3, unshared_blocks=4
    )


SAVED = Saved("c0ffee1", ("aaaaaaa", "bbbbbbb"))


def test_fork_text_heads_each_branch_with_its_saved_id_then_the_kv_use():
    res = _result(_branch("one", 3), _branch("two", 4))
    kv = "kv: 3 blocks (48 token slots) with sharing vs 4 blocks (64 slots) without; 0 copy-on-write copies"
    assert fork_text(_engine(), res, SAVED) == f"--- branch 1/2 aaaaaaa ---\none\n--- branch 2/2 bbbbbbb ---\ntwo\n{kv}"
    assert fork_text(_engine(), res, Saved()).startswith("--- branch 1/2 ---\none\n--- branch 2/2 ---\n")


def test_fork_json_gives_null_ids_and_no_conversation_when_not_saved():
    res = _result(_branch("one", 3), _branch("two", 4, "stop"))
    out = json.loads(dumps(fork_json(_engine(), res, Saved(), logprobs=False)))
    assert [b["id"] for b in out["branches"]] == [None, None] and "conversation_id" not in out
    two = {"id": None, "text": "two", "reasoning": "", "completion_tokens": 4, "finish_reason": "stop"}
    assert out["branches"][1] == two
    saved = fork_json(_engine(), res, SAVED, logprobs=False)
    assert [b["id"] for b in saved["branches"]] == ["aaaaaaa", "bbbbbbb"] and saved["conversation_id"] == "c0ffee1"
    assert list(saved) == ["prompt_tokens", "cached_tokens", "branches", "speculation", "ctx", "kv", "conversation_id"]


def test_reply_json_names_the_conversation_and_message_only_when_saved():
    r = _result(_branch("hi", 5))
    out = reply_json(_engine(), r, SAVED, logprobs=False)
    assert list(out)[-2:] == ["conversation_id", "message_id"]
    assert (out["conversation_id"], out["message_id"]) == ("c0ffee1", "aaaaaaa")
    assert out["kv"]["token_slots"] == 48 and out["kv"]["peak_active_tokens"] == 25
    assert "conversation_id" not in reply_json(_engine(), r, Saved(), logprobs=False)


def test_reply_verbose_adds_the_prefix_cache_policy_and_conversation_lines_when_they_apply():
    r = _result(_branch("hi", 5))
    lines = reply_verbose(_engine("sliding"), r, SAVED).split("\n")
    assert lines[3] == "prefix cache:         16/20 prompt tokens reused"
    assert lines[-2].startswith("kv policy:            sliding, budget 32 tokens; peak 25 active; 2 evictions")
    assert lines[-1] == "conversation:         c0ffee1 (message aaaaaaa)"
    plain = reply_verbose(_engine(prefix_caching=False), r, Saved()).split("\n")
    assert len(plain) == len(lines) - 3 and plain[-1] == "finish reason:        length"


def test_fork_verbose_names_the_conversation_only_when_saved():
    res = _result(_branch("one", 3), _branch("two", 4))
    assert fork_verbose(_engine(), res, SAVED).endswith("\nconversation:         c0ffee1")
    assert fork_verbose(_engine(), res, Saved()).endswith("context:              64 tokens per sequence (--ctx)")
