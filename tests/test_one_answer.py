"""One answer per prompt: a token's logits, and the K/V rows it writes to the pool, are a function
of the tokens alone, bitwise, not of how its forward pass was cut (chunk size, prefix-cache hit
from the pool or the disk, fork, preemption and recompute, offload recall, the scheduler's
batching). np.array_equal throughout, never a tolerance: "close" is what the prefix cache used to
change answers with.

Every architecture the tests make (scripts/make_model.py's tiny recipes, here with a small byte
vocabulary so nothing is fetched) at Q8_0, and the plain Llama at Q4_1 (SmolLM2's type) and Q4_K.
Prompts are long enough for every path: passes of 1, 2-8, 9-32 and more than 32 rows, and short
passes after more than 256 positions. With LOCALKV_CPU_KERNELS=0 (numpy) the same checks run in a
child process (test_the_numpy_path_agrees_with_itself_too).
"""

import dataclasses
import importlib.util
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_scheduler import drain

from localkv.backends.cpu import build
from localkv.backends.cpu.threads import CoreShare
from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.generation import Generation
from localkv.kv.evict import EvictConfig
from localkv.sampling import SamplingParams
from localkv.scheduler import Scheduler
from localkv.sequence import Sequence
from tiny_model import MERGES, SPECIALS, byte_vocab, write_gguf

ROOT = Path(__file__).resolve().parent.parent
KERNELS_OFF = os.environ.get("LOCALKV_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off")
RECIPES = ("llama3", "llama2", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "phi3-128k")
# name[@kv-dtype]: the pool's K/V format (default f16); quantized K/V through the plain Llama (every
# kernel path) and Gemma 2 (soft-capping, the sliding window)
KV_QUANT = ["llama-Q4_1@q8_0", "gemma2-Q8_0@q8_0", "llama-Q4_1@q4_0", "llama-Q4_1@q8_0:q4_0"]
MODELS = [*(f"{r}-Q8_0" for r in RECIPES), "llama-Q4_1", "llama-Q4_K", *KV_QUANT]
CHUNKS = (1, 3, 16, 31, 32, 33, 512)


N_PROMPT = 300  # past 256 positions: the short passes after a long context run their own attention
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
RNG = np.random.default_rng(30)
PROMPT = RNG.integers(3, 261, N_PROMPT).tolist()


def _make_model():
    name = "make_model"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _recipe_gguf(path: Path, recipe: str, quant: str) -> Path:
    """make_model's tiny recipe (its architecture's tensors and metadata) with the byte vocabulary
    of tiny_model, 2-D weights quantized by gguf-py."""
    import gguf
    from gguf.quants import quantize

    mm = _make_model()
    r = dataclasses.replace(mm.RECIPES[f"tiny-{recipe}"], n_vocab=None)
    tokens = byte_vocab()
    vocab = mm.Vocab("gpt2", "smollm", tokens, [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    vocab.merges, vocab.ids = list(MERGES), {"bos": 1, "eos": 2}
    gw = gguf.GGUFWriter(str(path), r.arch)
    mm._add_metadata(gw, r, vocab, "one-answer")
    qtype = gguf.GGMLQuantizationType[quant]
    for name, t in mm.iter_weights(r, len(tokens), 0):
        if t.ndim == 2:
            gw.add_tensor(name, quantize(t, qtype), raw_dtype=qtype)
        else:
            gw.add_tensor(name, t)
    gw.write_header_to_file()
    gw.write_kv_data_to_file()
    gw.write_tensors_to_file()
    gw.close()
    return path


@dataclasses.dataclass(frozen=True)
class Model:
    path: Path
    kv_dtype: str  # the pool's K/V format, as --kv-dtype says it


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("one-answer")
    made = {}

    def get(ref: str) -> Model:
        name, _, kv = ref.partition("@")
        if name not in made:
            arch, quant = name.rsplit("-", 1)
            if arch == "llama":  # tiny_model's Llama, at real head size (64) so the kernels attend
                kw = dict(dim=256, ffn=768, n_heads=4, n_kv_heads=2)
                made[name] = write_gguf(root / f"{name}.gguf", quant=quant, ctx=1024, **kw)
            else:
                made[name] = _recipe_gguf(root / f"{name}.gguf", arch, quant)
        return Model(made[name], kv or "f16")

    return get


def engine(model: Model, **kw) -> Engine:
    kw.setdefault("kv_dtype", model.kv_dtype)
    kw.setdefault("disk_cache", False)
    kw.setdefault("ctx", 1024)
    kw.setdefault("block_size", 16)
    kw.setdefault("threads", 2)
    return Engine(EngineConfig(model=model.path, **kw))


def kv_rows(eng: Engine, seq: Sequence, n: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V of the sequence's first n tokens, every layer, as the pool stores them: [layers, n, kv heads, row]."""
    table = np.asarray(seq.block_table)
    pool = eng.pool
    k = pool.k[:, table].reshape(pool.k.shape[0], -1, *pool.k.shape[3:])[:, :n]
    v = pool.v[:, table].reshape(pool.v.shape[0], -1, *pool.v.shape[3:])[:, :n]
    return k.copy(), v.copy()


def prefill(path, chunk: int, tokens=PROMPT, **kw):
    eng = engine(path, prefill_chunk=chunk, prefix_cache=False, **kw)
    seq = Sequence(list(tokens))
    logits = eng.prefill(seq).copy()
    return logits, *kv_rows(eng, seq, len(tokens))


def assert_same(got, want, what: str):
    __tracebackhide__ = True
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or not np.array_equal(got, want):
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64)).max() if got.shape == want.shape else "shape"
        pytest.fail(f"{what}: not bitwise equal (max |diff| {diff})")


# ---------------------------------------------------------------- chunk sizes


@pytest.mark.parametrize("name", MODELS)
def test_chunk_size_changes_no_logit_and_no_kv_row(models, name):
    """The last prompt token's logits and every K/V row in the pool, with the prompt cut into
    chunks of 1 (the decode step), 3, 16, 31, 32 (the few-row kernels), 33 and 512 (the many-row
    path), equal those of one pass."""
    path = models(name)
    ref_logits, ref_k, ref_v = prefill(path, 512)
    for chunk in CHUNKS[:-1]:
        logits, k, v = prefill(path, chunk)
        assert_same(k, ref_k, f"{name}: K rows at chunk {chunk}")
        assert_same(v, ref_v, f"{name}: V rows at chunk {chunk}")
        assert_same(logits, ref_logits, f"{name}: last-token logits at chunk {chunk}")


# ---------------------------------------------------------------- thread count


def fixed_threads(eng: Engine, n: int) -> Engine:
    """The engine on exactly n threads: CoreShare would give a thread up while other processes
    (a parallel test run) hold a core, and the two runs must differ in their count."""
    eng.backend._cores = CoreShare(n, machine=lambda: None)
    return eng


@pytest.mark.parametrize("name", ["llama-Q4_1", "llama-Q4_K", "llama3-Q8_0", "gemma2-Q8_0@q8_0"])
def test_the_thread_count_changes_no_logit_and_no_kv_row(models, name):
    """Prefill in passes of 1, 16 and 512 rows, then greedy decoding: one thread or two, the same
    bits (each output value has one reduction order, whatever thread computes it)."""
    path = models(name)
    for chunk in (1, 16, 512):
        runs = []
        for n in (1, 2):
            eng = fixed_threads(engine(path, prefill_chunk=chunk, prefix_cache=False, threads=n), n)
            seq = Sequence(list(PROMPT))
            runs.append((eng.prefill(seq).copy(), *kv_rows(eng, seq, len(PROMPT))))
        for what, got, want in zip(("logits", "K rows", "V rows"), runs[0], runs[1]):
            assert_same(got, want, f"{name}: {what} at chunk {chunk}, 1 thread vs 2")
    one, two = (generate(fixed_threads(engine(path, prefix_cache=False, threads=n), n), PROMPT) for n in (1, 2))
    assert_same_run(one, two, f"{name}: decoding on 1 thread vs 2")


# ---------------------------------------------------------------- cold vs warm


def record(gen: Generation) -> Generation:
    """Keep every logits row the generation samples from, per branch, in gen.rows."""
    gen.rows, advance = {}, gen.advance

    def spy(live, rows):
        rows = list(rows)
        for b, row in zip(live, rows):
            gen.rows.setdefault(b.index, []).append(np.array(row))
        return advance(live, rows)

    gen.advance = spy
    return gen


def generate(eng: Engine, prompt, params=GREEDY, n: int = 1) -> Generation:
    gen = record(Generation(eng, prompt, params, n))
    gen.run()
    return gen


def assert_same_run(got: Generation, want: Generation, what: str):
    __tracebackhide__ = True
    assert [b.tokens for b in got.result.branches] == [b.tokens for b in want.result.branches], what
    for i, rows in want.rows.items():
        assert_same(np.stack(got.rows[i]), np.stack(rows), f"{what}: logits of branch {i}")


WARM_MODELS = [
    "llama3-Q8_0",
    "qwen2-Q8_0",
    "gemma2-Q8_0",
    "llama-Q4_1",
    "llama-Q4_1@q8_0",
    "llama-Q4_1@q8_0:q4_0",
    "gemma2-Q8_0@q8_0",
]


@pytest.mark.parametrize("name", WARM_MODELS)
def test_a_pool_prefix_hit_changes_nothing(models, name):
    path = models(name)
    cold = generate(engine(path, prefix_cache=False), PROMPT)
    eng = engine(path)
    generate(eng, PROMPT[:-40])  # fills the pool's prefix cache with the first 16 blocks
    warm = generate(eng, PROMPT)
    assert warm.result.cached_tokens == 256
    assert_same_run(warm, cold, f"{name}: after a 256-token pool hit")
    again = generate(eng, PROMPT)  # the whole prompt cached but its last token
    assert again.result.cached_tokens == 288
    assert_same_run(again, cold, f"{name}: after a 288-token pool hit")


@pytest.mark.parametrize("name", WARM_MODELS)
def test_a_disk_prefix_hit_changes_nothing(models, name):
    path = models(name)
    cold = generate(engine(path, prefix_cache=False), PROMPT)
    generate(engine(path, disk_cache=True), PROMPT[:-40])
    warm = generate(engine(path, disk_cache=True), PROMPT)  # a new pool: only the disk helps
    assert warm.result.cached_tokens == 256
    assert_same_run(warm, cold, f"{name}: after a disk hit")


@pytest.mark.parametrize("name", WARM_MODELS)
def test_forked_branches_get_the_logits_of_a_lone_request(models, name):
    """Greedy branches decode in lockstep over their shared prompt (the cascade attention):
    each branch's logits equal a lone request's."""
    path = models(name)
    alone = generate(engine(path, prefix_cache=False), PROMPT)
    forked = generate(engine(path, prefix_cache=False), PROMPT, n=3)
    for i in range(3):
        assert forked.result.branches[i].tokens == alone.result.tokens
        assert_same(np.stack(forked.rows[i]), np.stack(alone.rows[0]), f"{name}: branch {i}")


@pytest.mark.parametrize("name", WARM_MODELS)
def test_preempted_requests_are_recomputed_to_the_same_logits(models, name):
    path = models(name)
    prompts = [RNG.integers(3, 261, n).tolist() for n in (120, 100, 90)]
    params = replace(GREEDY, max_tokens=40)
    alone = [generate(engine(path, prefix_cache=False), p, params) for p in prompts]
    probe = engine(path)
    per_block = probe.kv_bytes_per_token * probe.block_size
    eng = engine(path, prefix_cache=False, kv_mem=24 * per_block, ctx=256)  # 384 tokens for 430 at the end
    sched = Scheduler(eng)
    gens = [record(Generation(eng, p, params, queued=True)) for p in prompts]
    for g in gens:
        sched.add(g)
    drain(sched, gens)
    assert sched.preemptions > 0
    for i, (g, a) in enumerate(zip(gens, alone)):
        assert_same_run(g, a, f"{name}: request {i} after preemption")


@pytest.mark.parametrize("name", WARM_MODELS)
def test_offload_recall_gives_the_logits_of_the_full_cache(models, name):
    """Offload moves blocks out and recalls every one of them while they fit its recall slots:
    the logits equal those of the whole cache held in the pool."""
    path = models(name)
    tokens = PROMPT[:90]
    full = engine(path, prefix_cache=False, prefill_chunk=16, block_size=8).score(tokens)
    cfg = EvictConfig(policy="offload", budget=96, sinks=8, recent=16)  # 12 blocks: 4 resident, 8 recall slots
    eng = engine(path, prefix_cache=False, prefill_chunk=16, block_size=8, evict=cfg)
    got = eng.score(tokens)
    assert eng.stats.offloads >= 7 and eng.stats.recalls >= 7 and eng.stats.evictions == 0
    assert_same(got, full, f"{name}: logits with offloaded blocks recalled")


# ---------------------------------------------------------------- the scheduler


SYSTEM = RNG.integers(3, 261, 280).tolist()  # a shared system prompt past 256 positions
ASKS = [RNG.integers(3, 261, n).tolist() for n in (9, 30, 3, 45)]


@pytest.mark.parametrize("shared", [False, True], ids=["own-prompts", "system-prompt"])
@pytest.mark.parametrize("name", WARM_MODELS)
def test_requests_alone_together_or_staggered_get_the_same_logits(models, name, shared):
    """N requests run alone (a fresh engine each), all together, and staggered (each joins while
    the others decode, its prompt chunks sharing steps with their decodes): identical logits."""
    path = models(name)
    prompts = [(SYSTEM if shared else RNG.integers(3, 261, 200).tolist()) + a for a in ASKS]
    alone = [generate(engine(path, prefix_cache=False), p) for p in prompts]
    for staggered in (False, True):
        eng = engine(path, prefill_chunk=64)
        sched = Scheduler(eng)
        gens = [record(Generation(eng, p, GREEDY, queued=True)) for p in prompts]
        for g in gens:
            sched.add(g)
            while staggered and not g.done and len(g.rows.get(0, ())) < 3:
                sched.step()
        drain(sched, gens)
        how = "staggered" if staggered else "together"
        for i, (g, a) in enumerate(zip(gens, alone)):
            assert_same_run(g, a, f"{name}: request {i} {how}")


# ---------------------------------------------------------------- the numpy path


@pytest.mark.skipif(KERNELS_OFF or not build.load(), reason="this is the child process, or no kernels")
def test_the_numpy_path_agrees_with_itself_too():
    """LOCALKV_CPU_KERNELS=0 is its own numeric definition: the same checks in a child process."""
    env = dict(os.environ, LOCALKV_CPU_KERNELS="0")
    # the tiny models only: the real model's runs are the kernels' question, and minutes here
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-x", "-m", "not model", "-p", "no:xdist"]
    cmd += ["-p", "no:cacheprovider"]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


# ---------------------------------------------------------------- the real model

REAL_PROMPTS = [
    "Write a haiku about the sea.",
    "Summarize in one sentence: " + (ROOT / "tests" / "data" / "apache-2.0.txt").read_text()[:1500],
    "Name three uses of a paged KV cache.",
    "What is 17 times 23?",
]


def _run(model, prompt: str, *flags: str) -> str:
    cmd = [sys.executable, "-m", "localkv", "run", prompt, "-m", str(model), "-t", "0", "-n", "32", "--raw", *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.model
def test_the_real_model_answers_the_same_cold_and_warm(real_model_path):
    """SmolLM2, greedy 32 tokens, each run a new process: without the cache, filling the disk
    cache, and from it: the same text (issue 30's cold/warm experiment)."""
    for prompt in REAL_PROMPTS:
        cold = _run(real_model_path, prompt, "--no-cache")
        assert _run(real_model_path, prompt) == cold, prompt[:40]  # fills the disk cache
        assert _run(real_model_path, prompt) == cold, prompt[:40]  # served from it


STORIES = ["a lighthouse", "a lost key", "a robot cook", "the last train", "a paper boat", "an old map",
           "a quiet library", "a red kite"]  # fmt: skip
SYSTEM_PROMPT = "You are a storyteller. Every answer is a short story of a few sentences, told simply. " * 8


@pytest.mark.model
def test_the_real_model_served_alone_or_together_answers_the_same(real_model_path, tmp_path):
    """`localkv serve` on SmolLM2, 8 story requests after one shared system prompt at temperature
    0, through the openai client: sent one at a time, then all at once (batched, over the shared
    prefix): the same 8 answers (issue 30's server experiment)."""
    import asyncio

    from openai import AsyncOpenAI

    from localkv.bench.serve_load import localkv_server

    async def answers(client, together: bool) -> list[str]:
        model = (await client.models.list()).data[0].id

        async def one(story: str) -> str:
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"A story of {story}."},
            ]
            r = await client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=32)
            return r.choices[0].message.content

        if together:
            return list(await asyncio.gather(*(one(s) for s in STORIES)))
        return [await one(s) for s in STORIES]

    async def both(url: str):
        client = AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=600)
        try:
            return await answers(client, False), await answers(client, True)
        finally:
            await client.close()

    server = localkv_server(str(real_model_path), threads=2, kv_mem="256MiB", home=str(tmp_path)).wait_ready()
    try:
        alone, together = asyncio.run(both(server.url))
    finally:
        server.stop()
    assert together == alone
