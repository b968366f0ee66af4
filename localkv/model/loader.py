"""Load a Llama-architecture model: GGUF file or Hugging Face directory -> ModelConfig + fp32 weights.

Weights use one layout whatever the source: matrices [out, in], as GGUF stores them (y = x @ W.T):
    tok_embd [V, D]; per layer i: "{i}.attn_norm", "{i}.wqkv" [(H+2K)*hd, D] (q, k, v rows),
    "{i}.wo" [D, H*hd], "{i}.ffn_norm", "{i}.w_gate_up" [2F, D] (gate rows, then up rows),
    "{i}.w_down" [D, F]; out_norm [D]; output [D, V] (the output matrix transposed and
    contiguous, tied or not: a one-row BLAS gemv reads it fastest).
Q/K rows are in Hugging Face order (rotate halves, "NEOX" RoPE); GGUF stores them
interleaved for llama.cpp's pairwise RoPE, so GGUF rows are un-permuted on load.

A GGUF file is dequantized once and cached as safetensors beside it (or under
LOCALKV_HOME when that folder is read-only); later starts memory-map the cache.
"""

import hashlib
import json
import mmap
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localkv.errors import ModelError
from localkv.home import home
from localkv.model.config import ModelConfig

CACHE_VERSION = 4  # 2: output [D, V] stored contiguous even when tied (decode reads it every token)
# 3: ffn_down kept [D, F]: one decode row reads it 1.5x faster as W @ a than as a @ W.T
# 4: every matrix kept [out, in]: the decode kernels read weight rows, and 512-row prefill runs
#    (W @ x.T).T faster than x @ W (569 vs 618 ms over 30 layers)
SUPPORTED_QUANTS = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q8_K"}


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer: object
    path: Path
    load_s: float
    cache_hit: bool  # weights came from the safetensors cache (no dequantizing)


def load_model(path: Path, progress: bool = False) -> LoadedModel:
    t0 = time.perf_counter()
    path = Path(path)
    if path.is_dir():
        config, weights, tok = _load_hf_dir(path)
        hit = False
    else:
        config, weights, tok, hit = _load_gguf(path, progress)
    return LoadedModel(config, weights, tok, path, time.perf_counter() - t0, hit)


# ---------------------------------------------------------------- GGUF


def _open_gguf(path: Path):
    import gguf

    if not path.exists():
        raise ModelError(f"model file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (bad magic bytes)")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # truncated or corrupt: the reader raises many kinds
        raise ModelError(f"{path} is a corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None


def read_gguf_metadata(reader) -> dict:
    meta = {}
    for key, f in reader.fields.items():
        try:
            meta[key] = f.contents()
        except Exception:
            continue
    return meta


def _config_from_gguf(meta: dict, path: Path, fingerprint: str, n_params: int) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelError(f"{path.name}: unsupported architecture {arch!r} (localkv runs llama-architecture models)")

    def get(key, default=None):
        return meta.get(f"llama.{key}", default)

    try:
        dim, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
        tokens = meta.get("tokenizer.ggml.tokens") or []
        return ModelConfig(
            name=str(meta.get("general.name") or path.stem),
            n_layers=int(get("block_count")),
            dim=dim,
            ffn_dim=int(get("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv", n_heads)),
            vocab_size=int(get("vocab_size", len(tokens))),
            ctx_len=int(get("context_length", 2048)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            head_dim=int(get("attention.key_length", dim // n_heads)),
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_id=meta.get("tokenizer.ggml.eos_token_id"),
            fingerprint=fingerprint,
            n_params=n_params,
            file_size=path.stat().st_size,
        )
    except (TypeError, ValueError) as e:
        raise ModelError(f"{path.name}: incomplete llama metadata ({e})") from None


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF [out, in] Q/K rows (pairwise RoPE order) -> Hugging Face order (halves)."""
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _hf_weights(tensors: dict, cfg: ModelConfig, rows_gguf_order: bool) -> dict[str, np.ndarray]:
    """tensors: llama.cpp names -> fp32 [out, in] arrays. Returns the fused [out, in] layout."""
    w = {"tok_embd": tensors["token_embd.weight"], "out_norm": tensors["output_norm.weight"]}
    cfg.tied_embeddings = "output.weight" not in tensors
    # x @ E.T through a transposed view runs 2x slower than over a contiguous [D, V] copy
    w["output"] = np.ascontiguousarray(tensors.get("output.weight", w["tok_embd"]).T)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        q, k = tensors[p + "attn_q.weight"], tensors[p + "attn_k.weight"]
        if rows_gguf_order:
            q, k = _unpermute_rope(q, cfg.n_heads), _unpermute_rope(k, cfg.n_kv_heads)
        qkv = np.concatenate([q, k, tensors[p + "attn_v.weight"]])
        w[f"{i}.attn_norm"] = tensors[p + "attn_norm.weight"]
        w[f"{i}.wqkv"] = qkv
        w[f"{i}.wo"] = tensors[p + "attn_output.weight"]
        w[f"{i}.ffn_norm"] = tensors[p + "ffn_norm.weight"]
        w[f"{i}.w_gate_up"] = np.concatenate([tensors[p + "ffn_gate.weight"], tensors[p + "ffn_up.weight"]])
        w[f"{i}.w_down"] = tensors[p + "ffn_down.weight"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in w.items()}


def _load_gguf(path: Path, progress: bool):
    from localkv.model.tokenizer import Tokenizer

    if not path.exists():
        raise ModelError(f"model file not found: {path}")
    cache = _cache_path(path)
    cached = _read_cache(cache, path)
    if cached is not None:  # no GGUF parsing at all: the reader alone takes seconds on a 49k vocab
        weights, m = cached
        meta = json.loads(m["gguf_meta"])
        cfg = _config_from_gguf(meta, path, m["fingerprint"], int(m["n_params"]))
        cfg.quant, cfg.tied_embeddings = m["quant"], m.get("tied") == "1"
        return cfg, weights, Tokenizer.from_gguf_metadata(meta), True

    reader = _open_gguf(path)
    meta = read_gguf_metadata(reader)
    bad = {t.tensor_type.name for t in reader.tensors} - SUPPORTED_QUANTS
    if bad:
        raise ModelError(f"{path.name}: unsupported tensor type(s) {', '.join(sorted(bad))}")
    n_params = sum(int(t.n_elements) for t in reader.tensors)
    cfg = _config_from_gguf(meta, path, file_sha256(path), n_params)
    cfg.quant = _quant_name(reader)
    tok = Tokenizer.from_gguf_metadata(meta)
    tensors = _dequantize_all(reader, path, progress)
    try:
        weights = _hf_weights(tensors, cfg, rows_gguf_order=True)
    except KeyError as e:
        raise ModelError(f"{path.name}: missing tensor {e}") from None
    st = path.stat()
    _write_safetensors(
        cache,
        weights,
        {
            "version": str(CACHE_VERSION),
            "source_size": str(st.st_size),
            "source_mtime_ns": str(st.st_mtime_ns),
            "fingerprint": cfg.fingerprint,
            "quant": cfg.quant,
            "n_params": str(n_params),
            "tied": "1" if cfg.tied_embeddings else "0",
            "gguf_meta": json.dumps(meta, default=_jsonable),
        },
    )
    return cfg, weights, tok, False


def _jsonable(o):
    return o.item() if hasattr(o, "item") else list(o) if hasattr(o, "__iter__") else str(o)


def _quant_name(reader) -> str:
    """The dominant weight type, as llama.cpp's file_type names it (e.g. Q4_1)."""
    from collections import Counter

    counts = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    return counts.most_common(1)[0][0] if counts else "F32"


def _dequantize_all(reader, path: Path, progress: bool) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    out = {}
    tensors = list(reader.tensors)
    bar = _progress(progress, "dequantizing weights", len(tensors))
    try:
        for t in tensors:
            try:
                a = dequantize(t.data, t.tensor_type)
            except Exception as e:
                raise ModelError(f"{path.name}: cannot read tensor {t.name} ({e})") from None
            out[t.name] = np.asarray(a, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
            bar.advance()
    finally:
        bar.close()
    return out


class _progress:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, on: bool, what: str, total: int):
        self.p = None
        if on:
            from rich.console import Console
            from rich.progress import Progress

            self.p = Progress(console=Console(stderr=True), transient=True)
            self.p.start()
            self.task = self.p.add_task(what, total=total)

    def advance(self, n: int = 1):
        if self.p:
            self.p.advance(self.task, n)

    def close(self):
        if self.p:
            self.p.stop()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- weight cache (safetensors, mmap)


def _cache_path(path: Path) -> Path:
    name = f"{path.name}.localkv-v{CACHE_VERSION}.safetensors"
    beside = path.parent / name
    if os.access(path.parent, os.W_OK) or beside.exists():
        return beside
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    return home() / "weights" / f"{key}-{name}"


def _read_cache(cache: Path, src: Path) -> tuple[dict[str, np.ndarray], dict] | None:
    """The cached weights and metadata when the cache was made from this very file, else None."""
    try:
        _, meta = _read_header(cache)
        st = src.stat()
        if (meta.get("version"), meta.get("source_size"), meta.get("source_mtime_ns")) != (
            str(CACHE_VERSION),
            str(st.st_size),
            str(st.st_mtime_ns),
        ):
            return None
        return _read_safetensors(cache)
    except (OSError, ValueError, KeyError):
        return None  # a bad cache is rebuilt, never trusted


def _write_safetensors(dest: Path, weights: dict[str, np.ndarray], meta: dict[str, str]):
    from safetensors.numpy import save_file

    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        try:
            save_file(weights, tmp, metadata=meta)
            os.replace(tmp, dest)  # atomic: a reader sees the old cache or the whole new one
            for old in dest.parent.glob(dest.name.replace(f"-v{CACHE_VERSION}.", "-v*.")):
                if old != dest:  # another format version of the same model's cache: dead weight now
                    old.unlink(missing_ok=True)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        pass  # no cache is slower, never wrong


def _read_header(path: Path) -> tuple[dict, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 1 << 26:
            raise ValueError("header too large")
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", {})
    return header, meta


_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "I64": np.int64, "I32": np.int32}


def _read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """Memory-map a safetensors file: arrays are views of the page cache, loaded lazily."""
    header, meta = _read_header(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        # MAP_POPULATE: map every page now, at load, so the first forward does not take a page
        # fault per 4 KiB of weights (pages already in the page cache cost little to map)
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
    base = 8 + n
    out = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        if info["dtype"] == "BF16":
            raw = np.frombuffer(mm, np.uint16, (end - start) // 2, base + start)
            out[name] = (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])
            continue
        dt = np.dtype(_DTYPES[info["dtype"]])
        out[name] = np.frombuffer(mm, dt, (end - start) // dt.itemsize, base + start).reshape(info["shape"])
    return out, meta


# ---------------------------------------------------------------- Hugging Face directory


_HF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _load_hf_dir(path: Path):
    from localkv.model.tokenizer import Tokenizer

    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: cannot read config.json ({e})") from None
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    if hf.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        raise ModelError(f"{path.name}: unsupported architecture {archs[0]!r} (localkv runs llama-architecture models)")
    files = sorted(path.glob("*.safetensors"))
    if not files or not (path / "tokenizer.json").exists():
        raise ModelError(f"{path}: a model directory needs config.json, *.safetensors and tokenizer.json")
    tensors = {}
    h = hashlib.sha256()
    for f in files:
        try:
            arrays, _ = _read_safetensors(f)
        except (OSError, ValueError, KeyError) as e:
            raise ModelError(f"{f.name}: corrupt safetensors file ({e})") from None
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        for name, a in arrays.items():
            if name.startswith("model.layers."):
                _, _, i, rest = name.split(".", 3)
                name = f"blk.{i}.{_HF_LAYER.get(rest, rest)}"
            tensors[_HF_NAMES.get(name, name)] = np.asarray(a, dtype=np.float32)
    n_heads = int(hf["num_attention_heads"])
    cfg = ModelConfig(
        name=path.name,
        n_layers=int(hf["num_hidden_layers"]),
        dim=int(hf["hidden_size"]),
        ffn_dim=int(hf["intermediate_size"]),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads", n_heads)),
        vocab_size=int(hf["vocab_size"]),
        ctx_len=int(hf.get("max_position_embeddings", 2048)),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rms_eps=float(hf.get("rms_norm_eps", 1e-5)),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // n_heads),
        bos_id=hf.get("bos_token_id"),
        eos_id=hf.get("eos_token_id") if isinstance(hf.get("eos_token_id"), int) else None,
        quant=str(hf.get("torch_dtype", "F32")).upper().replace("FLOAT", "F").replace("BFLOAT", "BF"),
        fingerprint=h.hexdigest(),
        n_params=sum(int(a.size) for a in tensors.values()),
        file_size=sum(f.stat().st_size for f in files),
    )
    if hf.get("tie_word_embeddings", True) and "output.weight" in tensors:
        tensors.pop("output.weight")  # tied: the output matrix is the embedding
    try:
        weights = _hf_weights(tensors, cfg, rows_gguf_order=False)
    except KeyError as e:
        raise ModelError(f"{path.name}: missing tensor {e}") from None
    return cfg, weights, Tokenizer.from_hf_dir(path)
