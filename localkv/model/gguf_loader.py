"""Load a GGUF model file in place: its tensors stay in the file's encoding, read-only views of
one memory map (model/gguf.py), and nothing is written beside it.

Before anything is allocated the metadata is read as typed, ranged numbers and checked against
the tensors present (model/validate.py), and every tensor's type against the types the kernels
compute on. Per-architecture differences are data (model/arch.py).
"""

import glob
import hashlib
import os
from collections import Counter
from pathlib import Path

import numpy as np

from localkv.backends.cpu.quant import SUPPORTED, QTensor
from localkv.errors import ModelError
from localkv.home import home
from localkv.model.arch import ARCHITECTURES, Arch, describe
from localkv.model.config import ModelConfig
from localkv.model.gguf import GGUFFile, open_gguf
from localkv.model.validate import MAX_CONTEXT, MAX_HEADS, MAX_LAYERS, Meta, check_heads, check_tensors
from localkv.model.weights import layout, vector

FLOATS = ("F32", "F16", "BF16")  # what a norm vector may be stored as
SAMPLE = 4096  # bytes of each tensor hashed into the fingerprint, at its start, middle and end


def load_gguf(path: Path) -> tuple[ModelConfig, dict, object]:
    """(config, weights as model/weights.py lays them out, tokenizer) of a GGUF file."""
    from localkv.model.tokenizer import Tokenizer

    g = open_gguf(path)
    arch = g.meta.get("general.architecture")
    spec = ARCHITECTURES.get(arch) if isinstance(arch, str) else None
    if spec is None:
        raise ModelError(
            f"{path.name}: unsupported architecture {arch!r} (localkv runs {', '.join(sorted(ARCHITECTURES))} models)"
        )
    cfg = config_from_meta(g, path, arch, spec)
    check_tensors(cfg, {n: t.shape for n, t in g.tensors.items()}, path.name)
    check_types(g, path.name)
    tok = Tokenizer.from_gguf_metadata(_plain(g.meta))
    cfg.bos_id, cfg.eos_id = tok.bos_id, tok.eos_id
    cfg.fingerprint = fingerprint(path, g)
    for name, field in ROPE_FACTORS.items():
        if name in g.tensors:
            setattr(cfg, field, _freq_factors(vector(g.data(name)), name, path.name))
    weights = layout(lambda name: _tensor(g, name), cfg, lambda name: name in g.tensors)
    cfg.tied_embeddings = "output" not in weights
    drop_stale_caches(path)
    return cfg, weights, tok


def config_from_meta(g: GGUFFile, path: Path, arch: str, spec: Arch) -> ModelConfig:
    """The ModelConfig the metadata describes, every number read typed and in range."""
    meta, src = g.meta, path.name
    m = Meta(meta, src, prefix=f"{arch}.")
    dim = m.integer("embedding_length")
    n_heads = m.integer("attention.head_count", hi=MAX_HEADS)
    n_kv = m.integer("attention.head_count_kv", n_heads, hi=MAX_HEADS)
    if f"{arch}.attention.key_length" not in meta and dim % n_heads:
        raise m.fail("attention.head_count", n_heads, f"does not divide the embedding width {dim}")
    head_dim = m.integer("attention.key_length", dim // n_heads)
    for key in ("attention.value_length", "rope.dimension_count"):
        if m.integer(key, head_dim) != head_dim:
            raise m.fail(key, meta[f"{arch}.{key}"], f"differs from the head width {head_dim} (not supported)")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelError(f"{src}: the GGUF has no tokenizer.ggml.tokens: it carries no vocabulary")
    _check_vocab_arrays(meta, len(tokens), src)
    if meta.get("tokenizer.ggml.model") == "gpt2" and "tokenizer.ggml.merges" not in meta:
        raise ModelError(f"{src}: the BPE tokenizer has no tokenizer.ggml.merges: the file is incomplete")
    vocab = len(tokens)
    if m.integer("vocab_size", vocab) != vocab:
        raise m.fail("vocab_size", meta[f"{arch}.vocab_size"], f"differs from the {vocab} tokens of the vocabulary")
    cfg = ModelConfig(
        name=str(meta.get("general.name") or path.stem),
        n_layers=m.integer("block_count", hi=MAX_LAYERS),
        dim=dim,
        ffn_dim=m.integer("feed_forward_length"),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        vocab_size=vocab,
        ctx_len=m.integer("context_length", 2048, hi=MAX_CONTEXT),
        rope_theta=m.number("rope.freq_base", 10000.0, 0.0, float("inf")),
        rms_eps=m.number("attention.layer_norm_rms_epsilon", 1e-5, 0.0, 1.0),
        head_dim=head_dim,
        quant=_dominant_type(g),
        n_params=sum(int(np.prod(t.shape)) for t in g.tensors.values()),
        file_size=g.file_size,
        arch=arch,
    )
    check_heads(cfg, src)
    describe(cfg, spec, m)
    return cfg


def _check_vocab_arrays(meta: dict, n: int, src: str):
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        v = meta.get(key)
        if v is not None and (not isinstance(v, np.ndarray) or v.ndim != 1 or len(v) != n):
            shown = f"{len(v)} entries" if hasattr(v, "__len__") else repr(v)
            raise ModelError(f"{src}: {key} holds {shown}, not one number for each of the {n} tokens")


def check_types(g: GGUFFile, src: str):
    """Every tensor is of a type the kernels compute on (norms: a float type), else one line."""
    for name, t in g.tensors.items():
        ok = t.qtype in (FLOATS if len(t.shape) == 1 else SUPPORTED)
        if not ok or len(t.shape) > 2:
            raise ModelError(
                f"{src}: tensor {name!r} is {t.qtype}{' with ' + str(len(t.shape)) + ' dimensions' if ok else ''}, "
                f"which localkv cannot compute on (it runs {', '.join(sorted(SUPPORTED))}); "
                "use a Q2_K..Q8_0, Q4_K_M or Q5_K_M file"
            )


def _tensor(g: GGUFFile, name: str):
    info = g.tensors[name]
    data = g.data(name)
    if len(info.shape) == 1:
        return vector(data)
    return QTensor(data, info.qtype, info.shape)


# RoPE frequency divisors: Llama 3's rope_freqs, or Phi-3 LongRoPE's short (the same field: up to
# the original context) and long factors (ModelConfig.rope_factors_long)
ROPE_FACTORS = {
    "rope_freqs.weight": "rope_freq_factors",
    "rope_factors_short.weight": "rope_freq_factors",
    "rope_factors_long.weight": "rope_factors_long",
}


def _freq_factors(f: np.ndarray, name: str, src: str) -> tuple[float, ...]:
    if not (np.isfinite(f).all() and (f > 0).all()):
        raise ModelError(f"{src}: tensor {name!r} holds values that are not finite and positive")
    return tuple(float(x) for x in f)


def _plain(meta: dict) -> dict:
    """The metadata as the tokenizer reads it: numeric arrays as lists."""
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in meta.items()}


def _dominant_type(g: GGUFFile) -> str:
    """The most common matrix type (e.g. Q4_1 for a Q4_1 file with a Q8_0 embedding)."""
    counts = Counter(t.qtype for t in g.tensors.values() if len(t.shape) > 1)
    return counts.most_common(1)[0][0] if counts else "F32"


def fingerprint(path: Path, g: GGUFFile) -> str:
    """What identifies the weights (it keys the KV caches): a SHA-256 of the file's size, its
    whole header (metadata and tensor table) and SAMPLE bytes at the start, middle and end of
    every tensor. Hashing every byte would cost a start more than all else does (a 1B model's
    800 MB); a re-quantized or fine-tuned file differs in all of these."""
    h = hashlib.sha256(f"gguf-sampled-v1:{g.file_size}:".encode())
    start = min((t.offset for t in g.tensors.values()), default=g.file_size)
    # read, not through the mapping: a page fault maps the pages around it too (read-around),
    # and 3 samples of each tensor would leave most of a small model resident before it runs
    with open(path, "rb") as f:
        h.update(f.read(start))
        fd = f.fileno()
        for t in sorted(g.tensors.values(), key=lambda t: t.offset):
            mid = max(0, t.nbytes // 2 - SAMPLE // 2)
            for a, b in ((0, SAMPLE), (mid, mid + SAMPLE), (max(0, t.nbytes - SAMPLE), t.nbytes)):
                h.update(os.pread(fd, min(b, t.nbytes) - a, t.offset + a))
    return h.hexdigest()


def drop_stale_caches(path: Path):
    """Remove the fp32 weight caches older localkv versions wrote for this model (beside it, or
    under LOCALKV_HOME/weights): nothing reads them any more."""
    name = glob.escape(path.name) + ".localkv-v*.safetensors"
    key = hashlib.sha256(os.fsencode(path.resolve())).hexdigest()[:16]
    for old in [*path.parent.glob(name), *(home() / "weights").glob(f"{key}-{name}")]:
        try:
            old.unlink()
        except OSError:
            pass  # read-only folder: dead weight, never wrong
