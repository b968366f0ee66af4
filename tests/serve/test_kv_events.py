"""KV events (serve/kv_events.py) as a router reads them: a ZeroMQ subscriber decodes every
batch by the layout the README documents and rebuilds each medium's block set, which equals the
pool's and the disk tier's after a multi-turn load that evicts; each hash is the documented chain
hash of its tokens and parent; a subscriber that comes late gets the whole state; the replay
socket resends from a sequence number."""

import hashlib
import struct
import threading
import time

import httpx
import msgpack
import numpy as np
import pytest
import zmq

from localkv.config import EngineConfig, ServeOptions
from localkv.errors import LocalkvError
from localkv.serve.server import BackgroundServer
from tiny_model import write_gguf

RNG = np.random.default_rng(5)
DOCS = [RNG.integers(3, 261, 70).tolist() for _ in range(6)]  # one conversation's opening each


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("events") / "tiny.gguf", ctx=1024)


class Listener:
    """A SUB socket's messages, decoded in a thread: [(seq, [event maps])]."""

    def __init__(self, endpoint: str, topic: bytes = b""):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.connect(endpoint)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.batches: list[tuple[int, list]] = []
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if self.sock.poll(50):
                topic, seq, payload = self.sock.recv_multipart()
                ts, events = msgpack.unpackb(payload)  # vLLM's array-like EventBatch, no rank
                assert isinstance(ts, float) and isinstance(events, list)
                self.batches.append((struct.unpack(">q", seq)[0], events))
                self.last = time.monotonic()

    def quiet(self, for_s: float = 0.5, within: float = 60.0):
        """Wait until nothing came for for_s seconds (the publisher looks at its log every 50 ms)."""
        deadline = time.monotonic() + within
        while time.monotonic() - self.last < for_s:
            assert time.monotonic() < deadline, "the events never stopped"
            time.sleep(0.05)

    def close(self):
        self._stop.set()
        self._thread.join()
        self.sock.close()
        self.ctx.term()


def rebuild(batches: list, salt: bytes, block_size: int) -> dict[str, set[bytes]]:
    """Apply the events in order; check each stored block's hash against its chain."""
    held: dict[str, set[bytes]] = {"GPU": set(), "DISK": set()}
    for _, events in batches:
        for e in events:
            if e["type"] == "AllBlocksCleared":
                held = {m: set() for m in held}
            elif e["type"] == "BlockStored":
                assert e["block_size"] == block_size and e["lora_id"] is None and e["lora_name"] is None
                toks, parent = e["token_ids"], e["parent_block_hash"]
                assert len(toks) == block_size * len(e["block_hashes"])
                for i, h in enumerate(e["block_hashes"]):
                    assert h == chain_hash(salt, parent, toks[i * block_size : (i + 1) * block_size])
                    held[e["medium"]].add(h)
                    parent = h
            else:
                assert e["type"] == "BlockRemoved"
                held[e["medium"]] -= set(e["block_hashes"])
    return held


def chain_hash(salt: bytes, parent: bytes | None, tokens: list[int]) -> bytes:
    """The README's formula, written from it."""
    data = salt + (parent or bytes(16)) + struct.pack(f"<{len(tokens)}q", *tokens)
    return hashlib.sha256(data).digest()[:16]


def actual(server) -> tuple[dict[str, set[bytes]], bytes]:
    """The pool's findable blocks and the disk tier's entries of this model, as wire hashes."""
    e = server.runner.engine

    def read():
        pool = {h.to_bytes(16, "little") for h in e.pool.cached}
        disk = {b.hash.to_bytes(16, "little") for b in e.disk.blocks(e.model_config.fingerprint)}
        return {"GPU": pool, "DISK": disk}

    return server.runner.call(read).result(30), e.kv.salt


def turns(url: str, conversations: list[list[int]], n_turns: int):
    """Multi-turn traffic: each turn's prompt is the one before it and new tokens."""
    for _ in range(n_turns):
        for c, prompt in enumerate(conversations):
            body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            conversations[c] = prompt + RNG.integers(3, 261, 25).tolist()


def serve(tiny, **kw) -> BackgroundServer:
    engine = EngineConfig(model=str(tiny), kv_mem=kw.pop("kv_mem", "64KiB"), disk_cache_size="96KiB")
    return BackgroundServer(engine, ServeOptions(port=0, kv_events="tcp://127.0.0.1:*", **kw))


def test_events_rebuild_the_pool_and_the_disk_tier(tiny):
    with serve(tiny, kv_events_replay="tcp://127.0.0.1:*") as s:
        pub = s.runner.events
        first = Listener(pub.endpoint)
        time.sleep(0.3)  # a subscription reaches the publisher asynchronously
        turns(s.url, [list(d) for d in DOCS], 4)
        first.quiet()
        want, salt = actual(s)
        bs = s.runner.engine.block_size
        got = rebuild(first.batches, salt, bs)
        removed = {e["medium"] for _, ev in first.batches for e in ev if e["type"] == "BlockRemoved"}
        assert removed == {"GPU", "DISK"}  # the pool and the tier were small enough to evict: both checked
        assert want["GPU"] and want["DISK"]
        assert got == want
        assert [seq for seq, _ in first.batches] == list(range(len(first.batches)))

        late = Listener(pub.endpoint)  # a router that (re)connects: the whole state, no replay needed
        time.sleep(0.3)
        late.quiet()
        assert late.batches[0][1][0] == {"type": "AllBlocksCleared"}
        assert rebuild(late.batches, salt, bs) == actual(s)[0]
        late.close()
        first.close()

        ctx = zmq.Context()
        req = ctx.socket(zmq.DEALER)
        req.connect(pub.replay_endpoint)
        start = len(first.batches) // 2
        req.send_multipart([b"", struct.pack(">q", start)])
        resent = []
        while True:
            assert req.poll(10_000)
            _, seq, payload = req.recv_multipart()
            if seq == struct.pack(">q", -1):
                assert payload == b""
                break
            resent.append(struct.unpack(">q", seq)[0])
        assert resent[: len(first.batches) - start] == list(range(start, len(first.batches)))
        req.close()
        ctx.term()


def test_a_restarted_node_tells_its_disk_tier_first(tiny):
    with serve(tiny, kv_mem="4MiB") as s:
        turns(s.url, [list(d) for d in DOCS[:2]], 2)
        on_disk = actual(s)[0]["DISK"]
    assert on_disk
    with serve(tiny, kv_mem="4MiB") as s:  # the same LOCALKV_HOME: a warm disk tier
        listener = Listener(s.runner.events.endpoint)
        time.sleep(0.3)
        listener.quiet()
        got = rebuild(listener.batches, s.runner.engine.kv.salt, s.runner.engine.block_size)
        listener.close()
    assert got == {"GPU": set(), "DISK": on_disk}


def test_a_busy_endpoint_is_one_error_before_the_model_loads(tiny):
    with serve(tiny) as s:
        taken = s.runner.events.endpoint
        engine = EngineConfig(model=str(tiny), disk_cache=False)
        with pytest.raises(LocalkvError, match="cannot publish KV events at --kv-events"):
            BackgroundServer(engine, ServeOptions(port=0, kv_events=taken))
    with pytest.raises(LocalkvError, match="--kv-events-replay needs --kv-events"):
        ServeOptions(kv_events_replay="tcp://127.0.0.1:*").validate()


def test_render_gives_the_prompt_ids_the_server_computes(tiny):
    with serve(tiny) as s:
        prompt = DOCS[0][:40]
        r = httpx.post(s.url + "/v1/completions/render", json={"prompt": prompt}, timeout=60)
        assert r.status_code == 200 and r.json()[0]["token_ids"] == prompt
        r = httpx.post(s.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
        assert r.json()["usage"]["prompt_tokens"] == len(prompt)
        r = httpx.post(s.url + "/v1/completions/render", json={"prompt": [1, 99999]}, timeout=60)
        assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
