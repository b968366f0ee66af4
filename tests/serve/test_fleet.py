"""Three `localkv serve` nodes behind real routers, on loopback (bench/fleet.py): vllm-router's
kv_aware policy, fed each node's KV events, keeps a multi-turn replay's hit rate near one node's
and above round-robin's; a node killed and started again with its disk tier gets its
conversations back (they are read from its disk); a node killed for good loses no request; and
sglang-router lists the served model at /v1/models, so the openai client finds it and chats."""

import asyncio

import openai
import pytest

from localkv.bench.fleet import Node, documents, fleet, hit_rate, openings, replay
from tiny_model import write_gguf

pytestmark = pytest.mark.slow
CONVERSATIONS, TURNS = 5, 4  # 5 on 3 nodes: round-robin moves each conversation every turn
NAME = "tiny"  # the name each node lists (the file's name without .gguf)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("fleet") / f"{NAME}.gguf", ctx=2048)


def run(url: str, on_turn=None):
    """Turns after the first one request at a time: kv_aware weighs the nodes' load too, and under
    a loaded test run that would make its choices (and the hit rate) vary; alone, a choice is the
    cache's."""
    histories = openings(documents(CONVERSATIONS, 40))
    return asyncio.run(replay(url, histories, TURNS, NAME, gen=8, on_turn=on_turn, at_once=False))


def test_kv_aware_routes_by_the_blocks_each_node_reports(tiny, tmp_path):
    alone = Node(tiny, tmp_path / "alone").start().wait()
    try:
        one = hit_rate(run(alone.url))
    finally:
        alone.stop()
    homes = [tmp_path / f"rr{i}" for i in range(3)]
    with fleet(tiny, homes, "round_robin", NAME) as (router, _):
        rr = hit_rate(run(router.url))
    homes = [tmp_path / f"kv{i}" for i in range(3)]
    with fleet(tiny, homes, "kv_aware", NAME) as (router, nodes):
        held = {}

        def on_turn(t: int):
            if t == 1:  # a restart with a warm disk tier, nothing sent meanwhile
                by_load = sorted(nodes, key=lambda n: -n.metric("localkv_requests_total"))
                held["restarted"], held["dead"] = by_load[0], by_load[1]  # each served a first turn
                router.restart(held["restarted"])
            if t == 2:
                held["dead"].kill()  # for good

        turns = run(router.url, on_turn)
        restarted = held["restarted"]
        back = restarted.metric("localkv_requests_total"), restarted.metric("localkv_disk_hit_tokens_total")
    assert [t for t in turns if t.error] == []  # no request lost, the node killed for good included
    kv = hit_rate(turns)
    print(f"hit rate, turns 2..{TURNS}: one node {one:.3f}, kv_aware {kv:.3f}, round_robin {rr:.3f}; restarted: {back}")
    assert one > 0.5
    assert kv >= 0.8 * one, (kv, one, rr)  # one conversation of six loses its node for good
    assert kv > rr, (kv, rr)
    assert back[0] >= 1 and back[1] > 0, back  # its conversations came back, read from its disk


def test_sglang_router_names_the_model(tiny, tmp_path):
    with fleet(tiny, [tmp_path / "a", tmp_path / "b"], "cache_aware", NAME) as (router, _):
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="-")
        model = client.models.list().data[0].id
        assert model == NAME
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.choices[0].message.content is not None
