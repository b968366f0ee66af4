"""Write GGUF models of real shapes and real tokenizers with random weights (fixed seed),
quantized with llama.cpp's own quantizer, for tests and benchmarks.

    python scripts/make_model.py NAME [--quant Q4_K_M,Q8_0] [--out DIR] [--seed N]
    python scripts/make_model.py --list

Files land in --out (default $LOCALKV_MODELS_CACHE or ~/.cache/localkv-models) as
NAME.F16.gguf plus NAME.QUANT.gguf per quant; a file whose recipe (shape, vocabulary,
seed, this script's format) is unchanged is not written again. The output is nonsense
text, but the cost per token and every code path of the architecture are the real model's.

Layouts follow llama.cpp's convert_hf_to_gguf.py, so a forward written from the Hugging
Face reference agrees with llama.cpp on these files:
- llama: attn_q/attn_k rows permuted for llama.cpp's pairwise RoPE (undo to get HF order);
  Llama 3 rope scaling as the rope_freqs tensor (per-frequency divisors), no scaling key.
- qwen2, qwen3, gemma2, gemma3, phi3: HF row order (NeoX-style RoPE on halves).
- gemma2/gemma3 norm weights are stored as llama.cpp wants them, i.e. HF's (1 + w).
- phi3: attn_qkv = [q; k; v] rows; ffn_up = [gate; up] rows (SiLU on the first half).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fetch_vocab  # sibling scripts
from gguf_vocab import Vocab, load_vocab, vocab_family, vocab_stamp

FORMAT = 2  # bump when the weights or metadata this script writes change


@dataclass(frozen=True)
class Recipe:
    name: str
    arch: str
    vocab: str  # a gguf_vocab.load_vocab name
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    head_dim: int | None = None  # written as attention.key_length when the model's config names it
    n_vocab: int | None = None  # vocabulary rows; a shorter tokenizer is padded with unused tokens
    ctx: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tied: bool = True
    kv: tuple = ()  # extra "{arch}.key" metadata as (key, value) pairs
    llama3_rope: tuple = ()  # (factor, low_freq_factor, high_freq_factor, original_context)
    longrope: int = 0  # Phi-3 128k: the original context of the short/long rope factors
    qk_gain: float = 1.0  # scales q/k weights so attention soft-capping bites
    logit_gain: float = 1.0  # scales the output norm so final soft-capping bites
    quants: tuple[str, ...] = ()  # written by default besides F16

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads


_GEMMA2 = (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0), ("attention.sliding_window", 32))
_GEMMA3 = (("attention.sliding_window", 32), ("rope.freq_base_swa", 10000.0))
RECIPES = {
    r.name: r
    for r in [
        # benchmark shapes (the real models' dimensions)
        Recipe("llama-3.2-1b", "llama", "smollm2", 16, 2048, 32, 8, 8192, head_dim=64, n_vocab=128256, ctx=131072,
               rope_theta=500000.0, llama3_rope=(32.0, 1.0, 4.0, 8192), quants=("Q4_K_M", "Q8_0")),
        Recipe("smollm2-360m", "llama", "smollm2", 32, 960, 15, 5, 2560, ctx=8192, rope_theta=100000.0,
               quants=("Q4_K_M", "Q8_0")),
        # tiny parity models: each family's real vocabulary and metadata, small dimensions
        Recipe("tiny-llama3", "llama", "llama3", 2, 256, 4, 2, 768, head_dim=64, ctx=131072, rope_theta=500000.0,
               llama3_rope=(32.0, 1.0, 4.0, 8192)),
        Recipe("tiny-llama2", "llama", "llama2", 2, 256, 4, 1, 768, ctx=2048, tied=False),  # TinyLlama-style
        Recipe("tiny-mistral", "llama", "mistral", 2, 256, 8, 2, 768, ctx=32768, rope_theta=1e6, tied=False),
        Recipe("tiny-qwen2", "qwen2", "qwen2.5", 2, 256, 4, 2, 768, n_vocab=151936, ctx=32768, rope_theta=1e6,
               rms_eps=1e-6),
        Recipe("tiny-qwen3", "qwen3", "qwen3", 2, 256, 4, 2, 768, head_dim=128, n_vocab=151936, ctx=40960,
               rope_theta=1e6, rms_eps=1e-6),
        Recipe("tiny-r1-distill", "qwen2", "r1-distill", 2, 256, 4, 2, 768, n_vocab=151936, ctx=131072,
               rope_theta=10000.0, rms_eps=1e-6),  # DeepSeek-R1-Distill-Qwen's shape, its template
        Recipe("tiny-gemma2", "gemma2", "gemma2", 4, 256, 4, 2, 1024, head_dim=64, ctx=8192, rms_eps=1e-6,
               kv=_GEMMA2, qk_gain=2.5, logit_gain=1.0),
        Recipe("tiny-gemma3", "gemma3", "gemma3", 6, 256, 4, 1, 1024, head_dim=64, n_vocab=262144, ctx=32768,
               rope_theta=1e6, rms_eps=1e-6, kv=_GEMMA3),
        Recipe("tiny-phi3", "phi3", "phi3", 2, 256, 4, 4, 768, ctx=4096, tied=False,
               kv=(("attention.sliding_window", 2047), ("rope.scaling.original_context_length", 4096))),
        Recipe("tiny-phi3-128k", "phi3", "phi3", 2, 256, 4, 4, 768, ctx=131072, tied=False, longrope=4096,
               kv=(("attention.sliding_window", 262144), ("rope.scaling.original_context_length", 4096))),
    ]
}  # fmt: skip


# ---- weights -----------------------------------------------------------------------


def _permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF q/k rows (RoPE on halves of each head) -> llama.cpp's pairwise order, as convert_hf_to_gguf."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(r: Recipe) -> np.ndarray:
    """Llama 3.1's per-frequency divisors: long wavelengths slowed by `factor`, short ones kept."""
    factor, low, high, orig = r.llama3_rope
    freqs = r.rope_theta ** (-np.arange(0, r.hd, 2, dtype=np.float64) / r.hd)
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid)).astype(np.float32)


def longrope_factors(r: Recipe) -> tuple[np.ndarray, np.ndarray]:
    """Phi-3 128k-style short and long factors (one per rotary frequency), rising with wavelength."""
    n = r.hd // 2
    short = np.linspace(1.0, 1.5, n, dtype=np.float32)
    long = np.geomspace(1.0, 40.0, n).astype(np.float32)
    return short, long


def make_weights(r: Recipe, n_vocab: int, seed: int) -> dict[str, np.ndarray]:
    return dict(iter_weights(r, n_vocab, seed))


class _Random:
    """Matrices N(0, gain^2/fan_in), so activations keep unit scale; norm weights near `center`."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def mat(self, rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return self.rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(gain / math.sqrt(cols))

    def rows(self, rows: int, cols: int, gain: float) -> np.ndarray:
        """A vocabulary matrix whose row norms vary (log-normal), as trained ones do: the logits'
        upper tail then has clear winners, so a top-1 comparison is not a coin toss between
        near-ties the way it is over N(0, 1) rows."""
        scale = np.exp(0.5 * self.rng.standard_normal(rows, dtype=np.float32))
        scale /= np.sqrt(np.mean(scale**2))
        return self.mat(rows, cols, gain) * scale[:, None]

    def norm(self, n: int, center: float = 1.0) -> np.ndarray:
        return (center * (1 + 0.1 * self.rng.standard_normal(n, dtype=np.float32))).astype(np.float32)


def iter_weights(r: Recipe, n_vocab: int, seed: int):
    """(llama.cpp tensor name, float32 array) in file order, generated one at a time so that a
    1B model never sits in memory as float32. The output head gives logits of spread ~3."""
    g = _Random(seed)
    # Gemma multiplies the embeddings by sqrt(dim) on the way in: smaller rows keep the residual
    # stream at the others' scale (else the input token dominates every layer), and a larger
    # output norm gives the tied head the same logit spread back.
    sqrt_dim = math.sqrt(r.dim) if r.arch.startswith("gemma") else 1.0
    yield "token_embd.weight", g.rows(n_vocab, r.dim, 3.0 / sqrt_dim)
    yield "output_norm.weight", g.norm(r.dim, r.logit_gain * (sqrt_dim if r.tied else 1.0))
    if not r.tied:
        yield "output.weight", g.rows(n_vocab, r.dim, 3.0)
    for i in range(r.n_layers):
        for name, t in _layer_weights(r, g):
            yield f"blk.{i}.{name}", t
    if r.llama3_rope:
        yield "rope_freqs.weight", llama3_rope_factors(r)
    if r.longrope:
        short, long = longrope_factors(r)
        yield "rope_factors_short.weight", short
        yield "rope_factors_long.weight", long


def _layer_weights(r: Recipe, g: _Random):
    q_rows, kv_rows = r.n_heads * r.hd, r.n_kv_heads * r.hd
    gemma = r.arch.startswith("gemma")
    yield "attn_norm.weight", g.norm(r.dim)
    wq, wk, wv = g.mat(q_rows, r.dim, r.qk_gain), g.mat(kv_rows, r.dim, r.qk_gain), g.mat(kv_rows, r.dim)
    if r.arch == "llama":
        wq, wk = _permute_rope(wq, r.n_heads), _permute_rope(wk, r.n_kv_heads)
    if r.arch == "phi3":
        yield "attn_qkv.weight", np.concatenate([wq, wk, wv])
    else:
        yield from (("attn_q.weight", wq), ("attn_k.weight", wk), ("attn_v.weight", wv))
    if r.arch == "qwen2":  # Qwen2's q/k/v biases are large; make them matter
        for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            yield f"attn_{name}.bias", 0.5 * g.rng.standard_normal(rows, dtype=np.float32)
    if r.arch in ("qwen3", "gemma3"):
        yield "attn_q_norm.weight", g.norm(r.hd)
        yield "attn_k_norm.weight", g.norm(r.hd)
    yield "attn_output.weight", g.mat(r.dim, q_rows)
    if gemma:
        yield "post_attention_norm.weight", g.norm(r.dim)
    yield "ffn_norm.weight", g.norm(r.dim)
    if r.arch == "phi3":
        yield "ffn_up.weight", g.mat(2 * r.ffn, r.dim)
    else:
        yield "ffn_gate.weight", g.mat(r.ffn, r.dim)
        yield "ffn_up.weight", g.mat(r.ffn, r.dim)
    yield "ffn_down.weight", g.mat(r.dim, r.ffn)
    if gemma:
        yield "post_ffw_norm.weight", g.norm(r.dim)


# ---- GGUF files ----------------------------------------------------------------------


def recipe_hash(r: Recipe, seed: int) -> str:
    blob = {"recipe": dataclasses.asdict(r), "seed": seed, "format": FORMAT, "vocab": vocab_stamp(r.vocab)}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def _add_metadata(gw, r: Recipe, vocab: Vocab, tag: str) -> None:
    a = r.arch
    gw.add_name(r.name)
    gw.add_string("localkv.recipe", tag)
    gw.add_file_type(1)  # LLAMA_FTYPE_MOSTLY_F16: 2-D tensors F16, the rest F32
    gw.add_quantization_version(2)
    ints = {"context_length": r.ctx, "embedding_length": r.dim, "block_count": r.n_layers}
    ints |= {"feed_forward_length": r.ffn, "attention.head_count": r.n_heads, "attention.head_count_kv": r.n_kv_heads}
    if a in ("llama", "phi3"):
        ints["rope.dimension_count"] = r.hd
    if a == "llama":
        ints["vocab_size"] = len(vocab.tokens)
    if r.head_dim:
        ints |= {"attention.key_length": r.head_dim, "attention.value_length": r.head_dim}
    for key, value in ints.items():
        gw.add_uint32(f"{a}.{key}", value)
    gw.add_float32(f"{a}.attention.layer_norm_rms_epsilon", r.rms_eps)
    gw.add_float32(f"{a}.rope.freq_base", r.rope_theta)
    if r.longrope:  # Phi-3's attention factor for a context stretched by ctx / original
        attn_factor = math.sqrt(1 + math.log(r.ctx / r.longrope) / math.log(r.longrope))
        gw.add_float32(f"{a}.rope.scaling.attn_factor", attn_factor)
    for key, value in r.kv:
        (gw.add_float32 if isinstance(value, float) else gw.add_uint32)(f"{a}.{key}", value)
    _add_vocab(gw, vocab)


def _add_vocab(gw, v: Vocab) -> None:
    gw.add_tokenizer_model(v.model)
    gw.add_tokenizer_pre(v.pre)
    gw.add_token_list(v.tokens)
    gw.add_token_types(v.types)
    if v.scores is not None:
        gw.add_token_scores(v.scores)
    if v.merges is not None:
        gw.add_token_merges(v.merges)
    for key, tid in v.ids.items():
        gw.add_uint32(f"tokenizer.ggml.{key}_token_id", int(tid))
    for key, flag in v.flags.items():
        gw.add_bool(f"tokenizer.ggml.{key}", bool(flag))
    if v.chat_template:
        gw.add_chat_template(v.chat_template)


def _write_atomic(path: Path, fill) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        fill(Path(tmp))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide the model from other users
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_gguf(r: Recipe, path: Path, seed: int = 0, vocab_only: bool = False, vocab_root: Path | None = None) -> Path:
    """Write the recipe's F16 GGUF (or only its metadata, which llama.cpp can open vocab_only)."""
    import gguf

    vocab = load_vocab(r.vocab, vocab_root)
    vocab.pad(r.n_vocab or len(vocab.tokens))

    def fill(tmp: Path) -> None:
        gw = gguf.GGUFWriter(tmp, r.arch)
        _add_metadata(gw, r, vocab, recipe_hash(r, seed))
        if not vocab_only:
            for name, t in iter_weights(r, len(vocab.tokens), seed):
                gw.add_tensor(name, t.astype(np.float16) if t.ndim == 2 else t)
        gw.write_header_to_file()
        gw.write_kv_data_to_file()
        gw.write_tensors_to_file()
        gw.close()

    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, fill)
    return path


def quantize(src: Path, dst: Path, quant: str) -> Path:
    """llama.cpp's llama_model_quantize with its default parameters, to one of its ftype names."""
    import ctypes

    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}", None)
    if ftype is None:
        raise ValueError(f"unknown quantization {quant!r} (e.g. Q4_K_M, Q8_0, Q4_1, Q5_K_M, Q6_K)")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    log = logging.getLogger("llama-cpp-python")  # llama.cpp logs every tensor it quantizes through it

    def fill(tmp: Path) -> None:
        level = log.level
        log.setLevel(logging.WARNING)
        try:
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        finally:
            log.setLevel(level)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize failed for {src.name} -> {quant}")

    _write_atomic(dst, fill)
    return dst


def models_cache() -> Path:
    return Path(os.environ.get("LOCALKV_MODELS_CACHE") or Path.home() / ".cache" / "localkv-models")


def _stamp_ok(path: Path, tag: str) -> bool:
    stamp = path.with_name(path.name + ".recipe")
    return path.exists() and stamp.exists() and stamp.read_text() == f"{tag} {path.stat().st_size}"


def _stamp(path: Path, tag: str) -> None:
    path.with_name(path.name + ".recipe").write_text(f"{tag} {path.stat().st_size}")


def build(name: str, quants: tuple[str, ...] | None = None, out: Path | None = None, seed: int = 0,
          vocab_root: Path | None = None) -> dict[str, Path]:  # fmt: skip
    """Write (or reuse) NAME.F16.gguf and NAME.QUANT.gguf; returns {"F16": path, QUANT: path, ...}."""
    r = RECIPES[name]
    out = out or models_cache()
    tag = recipe_hash(r, seed) + ("" if seed == 0 else f"-s{seed}")
    stem = name if seed == 0 else f"{name}-s{seed}"
    paths = {"F16": out / f"{stem}.F16.gguf"}
    if not _stamp_ok(paths["F16"], tag):
        write_gguf(r, paths["F16"], seed, vocab_root=vocab_root)
        _stamp(paths["F16"], tag)
    for q in r.quants if quants is None else quants:
        if q == "F16":
            continue
        import llama_cpp

        paths[q] = out / f"{stem}.{q}.gguf"
        qtag = f"{tag}-{q}-{llama_cpp.__version__}"
        if not _stamp_ok(paths[q], qtag):
            quantize(paths["F16"], paths[q], q)
            _stamp(paths[q], qtag)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write random-weight GGUFs of real model shapes and tokenizers.")
    ap.add_argument("name", nargs="?", help="a recipe name (see --list)")
    ap.add_argument("--quant", default=None, help="comma-separated llama.cpp ftypes, e.g. Q4_K_M,Q8_0")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: $LOCALKV_MODELS_CACHE)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true", help="list the recipes")
    args = ap.parse_args(argv)
    if args.list or not args.name:
        for r in RECIPES.values():
            shape = f"{r.n_layers}x{r.dim} heads {r.n_heads}/{r.n_kv_heads} ffn {r.ffn}"
            print(f"{r.name:16} {r.arch:7} {shape:32} vocab {r.vocab}")
        return 0 if args.list else 2
    if args.name not in RECIPES:
        print(f"make_model: unknown model {args.name!r} (known: {', '.join(RECIPES)})", file=sys.stderr)
        return 2
    quants = tuple(q.strip().upper() for q in args.quant.split(",") if q.strip()) if args.quant is not None else None
    family = vocab_family(RECIPES[args.name].vocab)
    try:
        if family is not None:
            fetch_vocab.fetch(family, fetch_vocab.cache_dir())
        paths = build(args.name, quants, args.out, args.seed)
    except (fetch_vocab.FetchError, FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"make_model: {e}", file=sys.stderr)
        return 1
    for q, p in paths.items():
        print(f"{q:7} {p}  ({p.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
