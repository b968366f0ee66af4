"""KV events for KV-aware routers (`localkv serve --kv-events tcp://HOST:PORT`): what the prefix
cache holds, in memory and on disk, published over ZeroMQ in vLLM's wire format, so a router
built for vLLM's events (vllm-router's kv_aware policy, llm-d) routes to the node holding a
conversation's blocks.

The wire, as vLLM's ZmqEventPublisher sends it (the README documents each field):
- PUB (here XPUB) socket bound at the endpoint; one message per batch, three frames: topic
  (--kv-events-topic, empty by default), sequence number (8 bytes, big-endian, signed, from 0),
  payload: msgpack of [ts, events] (vLLM's array-like EventBatch).
- an event is a msgpack map tagged by "type": BlockStored {block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name}, BlockRemoved {block_hashes, medium},
  AllBlocksCleared {}. A hash is 16 bytes (the first 16 of the block's SHA-256 chain hash).
- the replay socket (ROUTER, --kv-events-replay): a request [b"", start seq] is answered with
  [b"", seq, payload] for each batch kept from start on, then [b"", -1, b""].

Every new subscriber gets the whole state first (AllBlocksCleared, then every findable block,
parents first): a router that (re)connects late, or a node restarted with a warm disk tier,
needs no replay to be routed to.
"""

import struct
import threading
import time
from collections import deque

import msgpack
import zmq

from localkv.errors import LocalkvError
from localkv.kv.block_events import BlockLog, Cleared, Removed, Stored, chain_order

BATCH = 512  # events per message: a router refuses payloads past 16 MiB
KEEP = 10_000  # batches the replay socket can resend (vLLM's default buffer_steps)
TICK = 0.05  # seconds between two looks at the log
END = struct.pack(">q", -1)


def wire_hash(h: int) -> bytes:
    return h.to_bytes(16, "little")  # the digest's own first 16 bytes (block_tables.block_hash)


def encode(events: list, block_size: int) -> list[dict]:
    """Events as vLLM's maps; a run of stored blocks of one chain (each the parent of the next)
    on one medium is one BlockStored, a run of removals on one medium one BlockRemoved."""
    out: list[dict] = []
    last = None
    for e in events:
        if isinstance(e, Cleared):
            out.append({"type": "AllBlocksCleared"})
            last = None
        elif isinstance(e, Stored):
            prev = out[-1] if out else None
            if isinstance(last, Stored) and last.medium == e.medium and e.parent == last.hash:
                prev["block_hashes"].append(wire_hash(e.hash))
                prev["token_ids"].extend(e.tokens)
            else:
                out.append(_stored(e, block_size))
            last = e
        else:
            if isinstance(last, Removed) and last.medium == e.medium:
                out[-1]["block_hashes"].append(wire_hash(e.hash))
            else:
                out.append({"type": "BlockRemoved", "block_hashes": [wire_hash(e.hash)], "medium": e.medium})
            last = e
    return out


def _stored(e: Stored, block_size: int) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": [wire_hash(e.hash)],
        "parent_block_hash": None if e.parent is None else wire_hash(e.parent),
        "token_ids": list(e.tokens),
        "block_size": block_size,
        "lora_id": None,
        "medium": e.medium,
        "lora_name": None,
    }


class Publisher:
    """Binds at construction (a bad or busy endpoint is a LocalkvError before the model loads);
    publishes from its own thread once attach() gives it the engine's log."""

    def __init__(self, endpoint: str, replay: str | None = None, topic: str = ""):
        self.topic = topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._bind(zmq.XPUB, endpoint, "--kv-events")
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's arrival, not only a topic's first
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._replay = self._bind(zmq.ROUTER, replay, "--kv-events-replay") if replay else None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=KEEP)
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.log: BlockLog | None = None
        self.block_size = 0

    def _bind(self, kind: int, endpoint: str, flag: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close()
            self._ctx.term()
            raise LocalkvError(f"cannot publish KV events at {flag} {endpoint}: {e} (e.g. tcp://*:5557)") from None
        return sock

    def watch(self, engine):
        """Start publishing what engine's pool and disk tier hold (the disk's entries of this
        model are told first: a node restarted with a warm tier is routed to at once)."""
        log = BlockLog()
        if engine.disk is not None:
            on_disk = {e.hash: e for e in engine.disk.blocks(engine.model_config.fingerprint)}
            for e in chain_order(on_disk):
                log.stored(e.hash, e.parent, e.tokens, e.medium)
            engine.disk.log = log
        engine.pool.log = log
        self.log, self.block_size = log, engine.block_size
        self._thread = threading.Thread(target=self._run, name="localkv-kv-events", daemon=True)
        self._thread.start()

    def close(self):
        if self._ctx.closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()

    # ------------------------------------------------------------ its thread

    def _run(self):
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(TICK * 1000))
            if self._pub in ready and self._joined():
                self.log.take()  # the whole state follows: it covers them
                self._send(self.log.snapshot())
            if self._replay in ready:
                self._answer_replay()
            self._send(self.log.take())

    def _joined(self) -> bool:
        """Read the subscription messages waiting; True if a subscriber arrived."""
        joined = False
        while self._pub.poll(0):
            msg = self._pub.recv()
            joined |= msg[:1] == b"\x01"
        return joined

    def _send(self, events: list):
        for i in range(0, len(events), BATCH):
            payload = msgpack.packb([time.time(), encode(events[i : i + BATCH], self.block_size)])
            seq = struct.pack(">q", self._seq)
            self._pub.send_multipart([self.topic, seq, payload])
            self._kept.append((self._seq, payload))
            self._seq += 1

    def _answer_replay(self):
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request
            client, start = frames[0], struct.unpack(">q", frames[2])[0]
            for seq, payload in list(self._kept):
                if seq >= start:
                    self._replay.send_multipart([client, b"", struct.pack(">q", seq), payload])
            self._replay.send_multipart([client, b"", END, b""])
