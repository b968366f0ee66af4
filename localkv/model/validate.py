"""Model metadata checked against the tensors actually present, before anything is allocated.

A model file's metadata is not trusted (docs/SECURITY.md): a zero head count would divide by
zero, a NaN rope base poison every logit, a key length of 10^9 size gigabytes of buffers. Every
number a ModelConfig holds is read through `Meta` (right type, in range) and then every tensor's
shape is compared with what those numbers imply (`check_tensors`), so the weights and the
metadata agree or the load ends in one ModelError line naming the key or the tensor.
"""

import math
from collections.abc import Mapping

from localkv.errors import ModelError
from localkv.model.config import ModelConfig

# Upper bounds far past any real model; they keep a hostile number from sizing anything.
MAX_LAYERS = 4096
MAX_WIDTH = 1 << 20  # embedding, FFN, head and vocabulary sizes
MAX_HEADS = 1 << 12
MAX_CONTEXT = 1 << 24  # tokens; RoPE tables grow with the positions actually used, not with this


class Meta:
    """Typed reads of a metadata mapping (a GGUF's key/values, a config.json), each failure one
    ModelError line that names the key and the value found."""

    def __init__(self, values: Mapping, source: str, prefix: str = ""):
        self.values, self.source, self.prefix = values, source, prefix

    def fail(self, key: str, value, why: str) -> ModelError:
        shown = repr(value) if not isinstance(value, (list, tuple)) else f"a list of {len(value)}"
        return ModelError(f"{self.source}: {self.prefix}{key} is {shown}: {why}; the model's metadata is broken")

    def integer(self, key: str, default=None, lo: int = 1, hi: int = MAX_WIDTH) -> int:
        v = self.values.get(self.prefix + key, default)
        if v is None:
            raise ModelError(f"{self.source}: the metadata has no {self.prefix}{key}: the file is incomplete")
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(key, v, "not an integer")
        if not lo <= v <= hi:
            raise self.fail(key, v, f"outside {lo}..{hi}")
        return v

    def number(self, key: str, default: float, lo: float, hi: float) -> float:
        v = self.values.get(self.prefix + key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.fail(key, v, "not a number")
        if not math.isfinite(v) or not lo < v < hi:
            raise self.fail(key, v, f"not a finite number between {lo:g} and {hi:g}")
        return float(v)


def check_heads(cfg: ModelConfig, source: str):
    """Head counts and widths that can be laid out: before any shape is derived from them."""
    if cfg.n_heads % cfg.n_kv_heads:
        raise ModelError(
            f"{source}: {cfg.n_heads} attention heads cannot share {cfg.n_kv_heads} KV heads evenly: "
            "the model's metadata is broken"
        )
    if cfg.head_dim % 2:
        raise ModelError(f"{source}: head width {cfg.head_dim} is odd: RoPE needs an even width")


def expected_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(required, optional) tensor shapes, numpy order, by GGUF name, as cfg implies them (the
    architecture's extra tensors included: ModelConfig's qkv_bias, qk_norm, post_norms, fused)."""
    D, F, V, hd = cfg.dim, cfg.ffn_dim, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    req = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    opt = {"output.weight": (V, D)}
    opt |= {f"{name}.weight": (hd // 2,) for name in ("rope_freqs", "rope_factors_short", "rope_factors_long")}
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        req[p + "attn_norm.weight"] = (D,)
        if cfg.fused:
            req[p + "attn_qkv.weight"] = (q + 2 * kv, D)
        else:
            req |= {p + "attn_q.weight": (q, D), p + "attn_k.weight": (kv, D), p + "attn_v.weight": (kv, D)}
        if cfg.qkv_bias:
            req |= {p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)}
        if cfg.qk_norm:
            req |= {p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)}
        req |= {p + "attn_output.weight": (D, q), p + "ffn_norm.weight": (D,)}
        if cfg.fused:
            req[p + "ffn_up.weight"] = (2 * F, D)
        else:
            req |= {p + "ffn_gate.weight": (F, D), p + "ffn_up.weight": (F, D)}
        req[p + "ffn_down.weight"] = (D, F)
        if cfg.post_norms:
            req |= {p + "post_attention_norm.weight": (D,), p + "post_ffw_norm.weight": (D,)}
    return req, opt


def layer_count(names, source: str) -> int:
    """Layers present: blk.0 .. blk.N-1, with no gap."""
    seen = set()
    for name in names:
        if name.startswith("blk."):
            i = name.split(".", 2)[1]
            if not i.isdigit() or len(i) > 5:
                raise ModelError(f"{source}: tensor {name!r} has no layer number: the file is corrupt")
            seen.add(int(i))
    n = len(seen)
    if seen and max(seen) != n - 1:
        missing = min(set(range(max(seen) + 1)) - seen)
        raise ModelError(f"{source}: the file has no tensors of layer {missing} but has layer {max(seen)}")
    return n


def check_tensors(cfg: ModelConfig, shapes: Mapping[str, tuple], source: str):
    """Every tensor the model reads is present with the shape cfg implies, and nothing else is."""
    present = layer_count(shapes, source)
    if present != cfg.n_layers:
        raise ModelError(
            f"{source}: the metadata says {cfg.n_layers} layers (block_count) but the file holds {present}: "
            "the file is incomplete or its metadata is broken"
        )
    req, opt = expected_shapes(cfg)
    for name, want in req.items():
        got = shapes.get(name)
        if got is None:
            raise ModelError(f"{source}: missing tensor {name!r}: the file is incomplete or not a {cfg.arch} model")
        _same(name, got, want, cfg, source)
    for name, got in shapes.items():
        if name in req:
            continue
        if name not in opt:
            raise ModelError(
                f"{source}: unexpected tensor {name!r}: a {cfg.arch} model has none; the file is another "
                "architecture than its metadata says"
            )
        _same(name, got, opt[name], cfg, source)


def _same(name: str, got: tuple, want: tuple, cfg: ModelConfig, source: str):
    if tuple(got) != want:
        raise ModelError(
            f"{source}: tensor {name!r} is {list(got)}, but the metadata implies {list(want)} (width {cfg.dim}, "
            f"FFN {cfg.ffn_dim}, {cfg.n_heads}/{cfg.n_kv_heads} heads of {cfg.head_dim}, vocabulary "
            f"{cfg.vocab_size}): the metadata and the weights disagree"
        )
