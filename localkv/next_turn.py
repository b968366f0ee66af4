"""A chat's next prompt, cached before it is asked.

The prefix cache reuses what a turn computed: its prompt and the tokens it generated. The next
prompt starts with them only if the chat template writes the finished turn back as it was
generated, and the templates of thinking models do not: Qwen3's and the R1 distills' drop a
turn's thinking once a user message follows it, so the next prompt leaves the cached tokens
right after the assistant header, and the whole answer is prefilled again on every turn (other
templates trim or re-tokenize a reply too, by a token or a few).

So once a reply ends, the conversation is rendered as the template will write it next time, up
to where the next user message begins, and that prefix is prefilled into the prefix cache
while the user reads and types (the server: while it has nothing else to run). A warm that new
work interrupts keeps what it computed: whole blocks are cached as they are computed."""

from collections.abc import Callable

from localkv import reasoning
from localkv.engine import Engine
from localkv.errors import LocalkvError
from localkv.model.tokenizer import Tokenizer
from localkv.sampling import SamplingParams
from localkv.toolcalls import Plan

PROBES = ("A", "B")  # two next user messages that differ from their first character
# tokens a warm computes between two looks at `stop`: new work waits at most one such chunk
WARM_CHUNK = 64


def prefix_ids(
    tok: Tokenizer,
    messages: list[dict],
    answer: str,
    params: SamplingParams,
    extra: dict | None = None,
    tools: Plan | None = None,
) -> list[int]:
    """The token ids every next prompt of this chat starts with, once `answer` (the reply
    without its thinking, as a client sends it back) ends `messages`: the common part of the
    next prompt rendered (as reasoning.chat renders a turn) with two different user messages.
    Empty when the template refuses, or when the reply calls a tool (the next message is the
    tool's result, under ids the client writes)."""
    if tools is not None and tools.parse(answer)[1]:
        return []
    done = [*messages, {"role": "assistant", "content": answer}]
    try:
        a, b = (_ids(tok, [*done, {"role": "user", "content": p}], params, tools, extra) for p in PROBES)
    except LocalkvError:
        return []
    return a[: common_length(a, b)]


def common_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _ids(tok: Tokenizer, messages: list[dict], params: SamplingParams, tools, extra) -> list[int]:
    return tok.encode(reasoning.chat(tok, messages, params, tools, extra)[0])


def warm(engine: Engine, ids: list[int], stop: Callable[[], bool] = lambda: False) -> int:
    """Prefill the whole blocks of `ids` that the prefix cache lacks (in memory, and on disk
    when the disk tier is on), then free the sequence: its blocks stay cached. `stop()`, asked
    between chunks, ends it early. Returns the tokens computed."""
    bs = engine.block_size
    ids = ids[: len(ids) // bs * bs]
    if not engine.prefix_caching or not ids or not engine.admits(len(ids), 1):
        return 0
    # one token more, never computed into a whole block: a lookup always leaves the last token
    # to compute, and this way it can find every block of ids
    seq, cached = engine.open_sequence([*ids, ids[-1]], record=False)
    try:
        if cached >= len(ids):
            return 0
        while seq.pending and not stop():
            engine.forward([seq], min(WARM_CHUNK, engine.config.prefill_chunk))
        computed = min(len(ids), len(seq.tokens) - len(seq.pending))
        engine.persist_prompt(seq, computed, cached)
        return computed - cached
    finally:
        engine.free(seq)
