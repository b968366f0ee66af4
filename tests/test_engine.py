"""The engine on small random-weight models: paging, chunking and batching never change the math."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.errors import ContextOverflow, LocalkvError, PoolExhausted
from localkv.generation import Generation
from localkv.sampling import SamplingParams
from localkv.sequence import Sequence
from tiny_model import read_back, tiny_weights, write_gguf, write_hf_dir


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", ctx=128)


def engine(path, **kw):
    """f32 K/V unless asked: these tests hold paging, chunking and batching to the float32 math
    of a dense forward (f16 K/V, the CPU's default, has its own tests below)."""
    return Engine(EngineConfig(model=path, **({"kv_dtype": "f32"} | kw)))


def dense_reference(tokens, seed=0, weights=None, freq_factors=None, **shape):
    """An independent plain Llama forward on the Hugging Face weights (no pool, no paging):
    tiny_weights(seed, **shape), or the given ones (e.g. read_back of a quantized file);
    freq_factors divide the RoPE frequencies (Llama 3's rope_freqs)."""
    w, hp = tiny_weights(seed, **shape)
    w = w if weights is None else weights
    H, K, D = hp["n_heads"], hp["n_kv_heads"], hp["dim"]
    hd = D // H
    T = len(tokens)

    def norm(x, g):
        return x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * g

    inv = 10000.0 ** (-np.arange(0, hd, 2) / hd) / (1.0 if freq_factors is None else np.asarray(freq_factors))
    ang = np.arange(T)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):  # HF rotate_half
        rot = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return x * cos[:, None] + rot * sin[:, None]

    x = w["model.embed_tokens.weight"][tokens].astype(np.float64)
    for i in range(hp["n_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, H, hd))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, K, hd))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, K, hd)
        k, v = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + np.triu(np.full((T, T), -np.inf), 1)
        p_ = np.exp(s - s.max(-1, keepdims=True))
        p_ /= p_.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", p_, v).reshape(T, D)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        g, u = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    return norm(x, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T


PROMPT = list(np.random.default_rng(5).integers(3, 261, 40))


def test_prefill_matches_dense_reference(gguf_path):
    eng = engine(gguf_path)
    logits = eng.prefill(Sequence(PROMPT))
    np.testing.assert_allclose(logits, dense_reference(PROMPT)[-1], rtol=1e-3, atol=1e-3)


def test_token_by_token_decode_matches_dense_reference(gguf_path):
    eng = engine(gguf_path, block_size=4)
    seq = Sequence(PROMPT[:1])
    ref = dense_reference(PROMPT)
    eng.prefill(seq)
    for t in range(1, len(PROMPT)):
        seq.tokens.append(PROMPT[t])
        np.testing.assert_allclose(eng.decode([seq])[0], ref[t], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("block_size", [1, 2, 8, 16, 64])
@pytest.mark.parametrize("chunk", [1, 7, 512])
def test_block_size_and_chunking_do_not_change_logits(gguf_path, block_size, chunk):
    eng = engine(gguf_path, block_size=block_size, prefill_chunk=chunk)
    np.testing.assert_allclose(eng.prefill(Sequence(PROMPT)), dense_reference(PROMPT)[-1], rtol=1e-3, atol=1e-3)


TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _follows(got, want, qtype=""):
    """Within the rounding of int8 activations: block types quantize them per 32 values, the
    K-quants per 256 (llama.cpp's Q8_0 and Q8_K), for every matmul; about 1% of a logit on
    these random weights (a coarser step for the K-quants), whose logits are too flat for argmax
    to be stable."""
    err = np.abs(got - want)
    mean = 0.04 if qtype.endswith("_K") else 0.03
    assert err.mean() <= mean * np.abs(want).mean() and err.max() <= 0.05 * np.abs(want).max()


@pytest.mark.parametrize("qtype", TYPES)
def test_every_weight_type_computes_in_place(tmp_path, qtype):
    """Prefill (tiles dequantized, BLAS) and decode (kernels on the blocks) match a dense
    forward on the values the file holds, step by step."""
    shape = {"dim": 256, "ffn": 512} if qtype.endswith("_K") else {}
    path = write_gguf(tmp_path / "m.gguf", quant=qtype, ctx=128, **shape)
    ref = dense_reference(PROMPT, weights=read_back(path, **shape), **shape)
    eng = engine(path, block_size=4)
    _follows(eng.prefill(Sequence(PROMPT)), ref[-1], qtype)
    seq = Sequence(PROMPT[:1])
    eng.prefill(seq)
    for t in range(1, 12):
        seq.tokens.append(PROMPT[t])
        _follows(eng.decode([seq])[0], ref[t], qtype)


def test_prefill_and_decode_agree(tmp_path):
    """The same positions through prefill (many rows: BLAS on dequantized tiles) and through
    decode steps (one row: the kernels) give the same logits within int8 rounding."""
    path = write_gguf(tmp_path / "m.gguf", quant="Q4_1", ctx=128)
    eng = engine(path, block_size=4)
    all_rows = eng.score(PROMPT[:20])
    seq = Sequence(PROMPT[:1])
    rows = [eng.prefill(seq)]
    for t in range(1, 20):
        seq.tokens.append(PROMPT[t])
        rows.append(eng.decode([seq])[0])
    for t, row in enumerate(rows):
        _follows(row, all_rows[t])


def test_batched_decode_equals_each_sequence_alone(gguf_path):
    # three rows take the kernels' 8-lane path, one row alone the row-by-row path
    eng = engine(gguf_path, block_size=4)
    prompts = [PROMPT[:5], PROMPT[:17], PROMPT[3:30]]
    seqs = [Sequence(list(p)) for p in prompts]
    for s in seqs:
        eng.prefill(s)
    for s, t in zip(seqs, (7, 8, 9)):
        s.tokens.append(t)
    batched = eng.decode(seqs)
    for p, t, row in zip(prompts, (7, 8, 9), batched):
        np.testing.assert_allclose(row, dense_reference(p + [t])[-1], rtol=1e-3, atol=1e-3)


def test_hf_directory_gives_same_logits_as_gguf(gguf_path, tmp_path):
    hf = engine(write_hf_dir(tmp_path / "hf", ctx=128))
    np.testing.assert_allclose(
        hf.prefill(Sequence(PROMPT)), engine(gguf_path).prefill(Sequence(PROMPT)), rtol=1e-4, atol=1e-4
    )


def test_generation_frees_its_blocks_and_respects_max_tokens(gguf_path):
    eng = engine(gguf_path, block_size=4)
    r = Generation(eng, PROMPT[:10], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).run()
    assert r.completion_tokens == 12 and r.finish_reason == "length"
    assert r.peak_blocks == -(-(10 + 11) // 4)  # the last sampled token is never written
    assert eng.pool.num_free == eng.pool.num_blocks


def test_greedy_is_deterministic_and_seed_reproduces(gguf_path):
    eng = engine(gguf_path)
    greedy = [
        Generation(eng, PROMPT[:8], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)).run().tokens
        for _ in range(2)
    ]
    assert greedy[0] == greedy[1]
    a = (
        Generation(eng, PROMPT[:8], SamplingParams(temperature=50.0, seed=3, max_tokens=20, ignore_eos=True))
        .run()
        .tokens
    )
    b = (
        Generation(eng, PROMPT[:8], SamplingParams(temperature=50.0, seed=3, max_tokens=20, ignore_eos=True))
        .run()
        .tokens
    )
    c = (
        Generation(eng, PROMPT[:8], SamplingParams(temperature=50.0, seed=4, max_tokens=20, ignore_eos=True))
        .run()
        .tokens
    )
    assert a == b and a != c


def test_generation_stops_at_context_end(gguf_path):
    eng = engine(gguf_path)
    r = Generation(
        eng, PROMPT[:8] * 15, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    ).run()  # 120 of 128
    assert r.finish_reason == "context" and r.prompt_tokens + r.completion_tokens == 128


def test_prompt_longer_than_context_is_refused(gguf_path):
    with pytest.raises(ContextOverflow, match="context holds 128"):
        Generation(engine(gguf_path), PROMPT * 4, SamplingParams(max_tokens=10))


def test_request_larger_than_pool_is_refused_before_work(gguf_path):
    eng = engine(gguf_path, block_size=4, kv_mem=2 * 2 * 4 * 2 * 16 * 4 * 3)  # exactly 3 blocks
    assert eng.pool.num_blocks == 3
    with pytest.raises(PoolExhausted, match="needs 5 KV blocks"):
        Generation(eng, PROMPT[:10], SamplingParams(max_tokens=10))
    assert eng.pool.num_free == 3


def test_interrupt_frees_blocks(gguf_path):
    eng = engine(gguf_path)
    gen = Generation(eng, PROMPT[:8], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    it = iter(gen)
    next(it)
    it.close()  # what a Ctrl-C unwinding through the loop does to the generator
    assert eng.pool.num_free == eng.pool.num_blocks


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"block_size": 3}, "block size"),
        ({"kv_mem": "lots"}, "invalid size"),
        ({"kv_mem": "1KiB"}, "smaller than one KV block"),
        ({"threads": 0}, "thread"),
    ],
)
def test_bad_engine_settings(gguf_path, kw, msg):
    with pytest.raises(LocalkvError, match=msg):
        engine(gguf_path, **kw)


MALLOC_PROBE = r"""
import json, resource, sys
import numpy as np
from localkv import backends as backend
tuned = backend.tune_malloc()
def churn():  # a forward's temporaries: several sizes, allocated, written, freed
    for mb in (1, 3, 7, 2, 12, 5):
        a = np.ones(mb << 18, np.float32)
        b = a * 2.0
        del a, b
churn()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    churn()
print(json.dumps({"tuned": tuned, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_malloc_tuning_keeps_temporaries_mapped():
    """After tune_malloc, freed temporaries are reused without page faults; a user's own
    MALLOC_*_ tunables switch it off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = json.loads(
        subprocess.run([sys.executable, "-c", MALLOC_PROBE], env=env, capture_output=True, text=True, check=True).stdout
    )
    if not out["tuned"]:
        pytest.skip("not glibc")
    assert out["faults"] < 50  # 5 x 30 MB of temporaries would be ~38,000 faults if each were fresh
    off = json.loads(
        subprocess.run(
            [sys.executable, "-c", MALLOC_PROBE],
            env=env | {"MALLOC_TOP_PAD_": "131072"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert off["tuned"] is False


def test_rope_frequency_factors_of_the_file_are_applied(tmp_path):
    """A rope_freqs tensor (Llama 3's long-context scaling) divides the RoPE frequencies."""
    factors = np.array([1, 1, 1, 2, 4, 8, 16, 40], np.float32)  # head width 16: 8 frequencies
    path = write_gguf(tmp_path / "f.gguf", ctx=128, extra={"rope_freqs.weight": factors})
    eng = engine(path)
    assert eng.model_config.rope_freq_factors == tuple(factors.tolist())
    got = eng.prefill(Sequence(PROMPT))
    np.testing.assert_allclose(got, dense_reference(PROMPT, freq_factors=factors)[-1], rtol=1e-3, atol=1e-3)
    assert np.abs(got - dense_reference(PROMPT)[-1]).max() > 1e-2  # the factors matter here


def test_f16_kv_pool_halves_the_bytes_and_keeps_the_tokens(gguf_path):
    f32, f16 = engine(gguf_path, kv_dtype="f32"), engine(gguf_path, kv_dtype="f16")
    assert f32.pool.k.dtype == np.float32 and f16.pool.k.dtype == np.float16
    assert f32.kv_bytes_per_token == 2 * f16.kv_bytes_per_token == 2 * 2 * 32 * 4  # K and V, 2 layers, 2x16
    np.testing.assert_allclose(f16.prefill(Sequence(PROMPT)), f32.prefill(Sequence(PROMPT)), rtol=1e-2, atol=1e-2)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    runs = [Generation(e, PROMPT, params, n=3).run() for e in (f32, f16)]
    assert [b.tokens for b in runs[0].branches] == [b.tokens for b in runs[1].branches]


def test_kv_dtype_is_checked_before_loading(gguf_path):
    with pytest.raises(LocalkvError, match="unknown --kv-dtype 'q4'"):
        engine(gguf_path, kv_dtype="q4")
    assert Engine(EngineConfig(model=gguf_path)).pool.k.dtype == np.float16  # auto: the CPU's default


def test_disk_cache_entries_of_another_kv_dtype_are_misses(gguf_path):
    prompt = PROMPT * 2

    def cached(kv_dtype):
        eng = engine(gguf_path, kv_dtype=kv_dtype, block_size=8)
        seq, hit = eng.open_sequence(prompt)
        eng.prefill(seq)
        eng.persist_prompt(seq, len(prompt), hit)
        return hit

    assert cached("f32") == 0
    assert cached("f16") == 0  # the f32 entries are never read into an f16 pool
    assert cached("f32") == cached("f16") >= len(prompt) - 16  # each reads its own (the last token is run)


def test_a_start_runs_with_the_cyclic_collector_paused(gguf_path, monkeypatch):
    """Loading the model and the kernels allocates objects that live for good: the collector
    is off meanwhile, and as it was afterwards (on, or off where the caller turned it off)."""
    import gc

    import localkv.engine as engine_module

    seen = []
    load = engine_module.load_model
    monkeypatch.setattr(engine_module, "load_model", lambda *a, **k: seen.append(gc.isenabled()) or load(*a, **k))
    Engine(EngineConfig(model=str(gguf_path)))
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        Engine(EngineConfig(model=str(gguf_path)))
        assert seen == [False, False] and not gc.isenabled()
    finally:
        gc.enable()


def test_a_next_turn_writes_the_reply_blocks_it_found_in_memory(gguf_path):
    """Turn 2's prompt opens with turn 1's prompt and reply; the reply's blocks are a memory hit
    but were never written (replies are not), so turn 2 writes them: the disk holds its whole
    chain, and a later process restores all of it."""
    eng = engine(gguf_path, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reply = Generation(eng, PROMPT, params).run().branches[0].tokens
    second = PROMPT + reply + PROMPT[:9]
    res = Generation(eng, second, replace(params, max_tokens=1)).run()
    assert res.cached_tokens >= len(PROMPT) + 16  # the reply's full blocks came from memory
    fp, hashes = eng.model_config.fingerprint, eng.kv.chain(second, len(second) // 8)
    assert all(eng.disk.contains(fp, h) for h in hashes)
    later = engine(gguf_path, block_size=8)
    assert later.open_sequence(second)[1] == len(hashes) * 8


def test_a_start_loads_its_pool_and_weight_kernels_in_one_load(gguf_path, monkeypatch):
    """The pool's attention kernels load with the weights' (prepare_kv first): a first compile
    then shares all of them out at once, where two loads in turn each waited for their own."""
    import localkv.backends.cpu.build as build

    calls, load = [], build.load

    def recorded(types=(), progress=False, kv=()):
        calls.append((list(types), list(kv)))
        return load(types, progress, kv)

    monkeypatch.setattr(build, "load", recorded)
    eng = engine(gguf_path, kv_dtype="f16")
    assert calls == [(["F32"], ["f16"])], calls
    eng.backend.prepare_kv("f32")  # after the weights: at once
    assert calls[1:] == [([], ["f32"])]
