"""Llama forward pass over a flattened batch of sequences, K/V read and written only
through the block pool."""

from dataclasses import dataclass

import numpy as np

from localkv.backends.base import Backend
from localkv.errors import ModelError
from localkv.kv.block_pool import BlockPool
from localkv.kv.evict import AttendExtras
from localkv.model.config import ModelConfig


@dataclass(slots=True)
class Span:
    """One sequence's rows in a batch: tokens [start, start+length) are the last
    `length` of its n_ctx-token context, stored through block_table."""

    start: int
    length: int
    block_table: np.ndarray
    n_ctx: int
    extras: AttendExtras | None = None  # the KV policy's extra or positioned keys and attention-mass array, if any


ROPE_POSITIONS = 4096  # RoPE table rows made at start; more as positions are used


def check_backend(cfg: ModelConfig, backend: Backend):
    """Refuse, in one line and before any weight reaches the device, a model whose attention
    needs what the backend's paged_attention does not take (caps.attention_options)."""
    needs = {"softcap": cfg.attn_softcap > 0, "window": bool(cfg.local_layers)}
    missing = sorted(k for k, need in needs.items() if need and k not in backend.caps.attention_options)
    if missing:
        what = {"softcap": "attention soft-capping", "window": "sliding-window attention"}
        raise ModelError(
            f"{cfg.name}: the {backend.name} backend cannot run {cfg.arch} models yet "
            f"({', '.join(what[k] for k in missing)}); use --device cpu"
        )


class Rope:
    """cos/sin tables of one RoPE variant (base, frequency divisors, attention factor), grown as
    positions are used (a model's context may be millions of tokens; eviction runs past it)."""

    def __init__(self, backend: Backend, head_dim: int, theta: float, factors, attn_factor: float):
        self.backend, self.head_dim, self.theta = backend, head_dim, theta
        self.factors, self.attn_factor = factors, attn_factor
        self.cos = self.sin = backend.xp.empty((0, head_dim // 2), np.float32)

    def ensure(self, n: int):
        if n > len(self.cos):
            extra = {} if self.factors is None else {"factors": self.factors}
            cos, sin = self.backend.rope_tables(self.head_dim, max(n, 2 * len(self.cos)), self.theta, **extra)
            if self.attn_factor != 1.0:  # llama.cpp's rope attn_factor scales both (Phi-3 LongRoPE)
                cos, sin = cos * np.float32(self.attn_factor), sin * np.float32(self.attn_factor)
            self.cos, self.sin = cos, sin


class Llama:
    """The forward pass, written once in the backend's op set (localkv/backends/base.py); what an
    architecture adds (model/arch.py) are optional steps switched on by ModelConfig's fields."""

    def __init__(self, cfg: ModelConfig, weights: dict, backend: Backend, n_ctx: int | None = None):
        """n_ctx: the context the engine serves (default the model's): LongRoPE picks its factors by it."""
        self.cfg, self.w, self.backend = cfg, weights, backend
        factors, self.rope_variant = cfg.rope_freq_factors, ""
        if cfg.rope_factors_long is not None and (n_ctx or cfg.ctx_len) > cfg.rope_orig_ctx:
            factors, self.rope_variant = cfg.rope_factors_long, "-long"  # K rows differ: part of the cache key
        if cfg.rope_scale != 1.0:  # linear scaling: every frequency divided by the factor
            factors = tuple(f * cfg.rope_scale for f in (factors or (1.0,) * (cfg.head_dim // 2)))
        self.rope = Rope(backend, cfg.head_dim, cfg.rope_theta, factors, cfg.rope_attn_factor)
        self.local = frozenset(cfg.local_layers)
        self.rope_local = self.rope
        if cfg.rope_theta_local:  # Gemma 3's local layers: their own base, unscaled
            self.rope_local = Rope(backend, cfg.head_dim, cfg.rope_theta_local, None, 1.0)
        self.ensure_positions(min(cfg.ctx_len, ROPE_POSITIONS))
        self.scale = cfg.attn_scale or float(1.0 / np.sqrt(cfg.head_dim))
        # the output matrix [vocab, dim], stored [out, in] like every other: the embedding when tied
        self.w_out = weights.get("output", weights["tok_embd"])
        # soft-capped or windowed attention runs per sequence through paged_attention, which takes them
        self.plain_attention = not (cfg.attn_softcap or self.local)
        # a KV policy's keys by position (PositionedKV) where the backend takes per-kv-head tables
        self.positioned = "head_tables" in backend.caps.attention_options
        self.rotation = None  # kv/rotation's, set by the engine for a quantized pool
        # each layer's weights that forward() reads, looked up once (its loop runs once a layer
        # of every decode step)
        names = ("attn_norm", "wqkv", "wo", "ffn_norm", "w_gate_up", "w_down")
        self.layers = [tuple(weights[f"{i}.{n}"] for n in names) for i in range(cfg.n_layers)]

    def ensure_positions(self, n: int):
        """RoPE tables for positions up to n."""
        self.rope.ensure(n)
        self.rope_local.ensure(n)

    def _plan(self, spans: list[Span]) -> "AttentionPlan":
        """How this pass's attention runs, worked out once for every layer: the single-token
        spans (decodes, also those that share a step with other requests' prompt chunks) in one
        batched call; every other span (and every span of an architecture whose attention needs
        options) through its own table."""
        backend = self.backend
        single = [sp for sp in spans if sp.length == 1 and sp.extras is None] if self.plain_attention else []
        batch = self._decode_batch(single) if single else None
        if batch is None:
            single = []
        batched = {id(sp) for sp in single}
        others = [(sp, backend.frozen_table(sp.block_table)) for sp in spans if id(sp) not in batched]
        rows = backend.xp.asarray([sp.start for sp in single]) if single and others else None
        return AttentionPlan(rows, batch, others)

    def forward(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        spans: list[Span],
        pool: BlockPool,
        logit_rows: list[int],
    ) -> np.ndarray:
        """Runs T tokens; writes their K/V at slots; returns logits [len(logit_rows), vocab]."""
        cfg, w, backend = self.cfg, self.w, self.backend
        xp = backend.xp
        T = len(tokens)
        tokens, positions, slots = xp.asarray(tokens), xp.asarray(positions), xp.asarray(slots)
        backend.begin_forward(T)
        x = backend.embed(w["tok_embd"], tokens)
        if cfg.embed_scale != 1.0:
            x *= x.dtype.type(cfg.embed_scale)
        rope = self.rope.cos[positions], self.rope.sin[positions]
        rope_local = (
            rope if self.rope_local is self.rope else (self.rope_local.cos[positions], self.rope_local.sin[positions])
        )
        plan = self._plan(spans)
        eps, unturn = cfg.rms_eps, self.rotation is not None and self.rotation.v
        mlp = backend.gelu_mul if cfg.mlp == "gelu" else backend.silu_mul
        for i, (attn_norm, wqkv, wo, ffn_norm, w_gate_up, w_down) in enumerate(self.layers):
            h = backend.rmsnorm(x, attn_norm, eps)
            qkv = self._qkv(h, i, wqkv)
            kl, vl = pool.layers[i]
            q = self._rope_store(qkv, *(rope_local if i in self.local else rope), kl, vl, slots)
            attn = self._attention(i, q, kl, vl, plan)
            if unturn:  # the values were turned: turn back
                attn = backend.rotate(attn, self.rotation, undo=True)
            backend.add_residual(x, self._post_norm(backend.linear(attn.reshape(T, -1), wo, "wo"), i, "attn"))
            h = backend.rmsnorm(x, ffn_norm, eps)
            act = mlp(backend.linear(h, w_gate_up, "w_gate_up"))
            backend.add_residual(x, self._post_norm(backend.linear(act, w_down, "w_down"), i, "ffn"))
        h = backend.rmsnorm(x[xp.asarray(logit_rows)], w["out_norm"], cfg.rms_eps)
        logits = backend.logits(h, self.w_out)
        if cfg.final_softcap:  # Gemma 2: on the host's float32 logits
            logits = np.tanh(logits / np.float32(cfg.final_softcap)) * np.float32(cfg.final_softcap)
        return logits

    def _qkv(self, h, i: int, wqkv):
        """qkv [T, H + 2 kvh, hd] of layer i (its weight wqkv): projected (plus biases), q/k
        heads normalised where the architecture does."""
        cfg, w, backend = self.cfg, self.w, self.backend
        H, K, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv = backend.linear(h, wqkv, "wqkv")
        if cfg.qkv_bias:
            qkv += w[f"{i}.bqkv"]
        qkv = qkv.reshape(len(h), H + 2 * K, hd)
        if cfg.qk_norm:
            backend.head_rmsnorm(qkv[:, :H], w[f"{i}.q_norm"], cfg.rms_eps)
            backend.head_rmsnorm(qkv[:, H : H + K], w[f"{i}.k_norm"], cfg.rms_eps)
        return qkv

    def _rope_store(self, qkv, cos, sin, kl, vl, slots):
        """RoPE on qkv's q and k heads, the rotation's heads turned, K and V written to the
        layer's pool at slots (one backend call where it has one); returns q [T, H, hd]."""
        backend, H, K, style = self.backend, self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.rope_style
        rot = self.rotation
        if not backend.rope_store(qkv, cos, sin, style, rot, kl, vl, slots):
            backend.rope(qkv[:, : H + K], cos, sin, style)
            if rot is not None:  # one call for the heads that turn: Q and K, V, or all three
                turn = slice(*rot.heads(H, K))
                qkv[:, turn] = backend.rotate(qkv[:, turn], rot)
            backend.write_kv(kl, vl, slots, qkv[:, H : H + K], qkv[:, H + K :])
        return qkv[:, :H]

    def _post_norm(self, out, i: int, which: str):
        """A block's output as the residual stream receives it: RMSNorm'd where the architecture
        has post-norms (Gemma)."""
        if not self.cfg.post_norms:
            return out
        return self.backend.rmsnorm(out, self.w[f"{i}.post_{which}_norm"], self.cfg.rms_eps)

    def _attention(self, i: int, q, kl, vl, plan: "AttentionPlan"):
        """Attention of every row of the pass: the batched single-token spans in one call, the
        rest span by span."""
        if not plan.others:
            return self._batched(q, kl, vl, plan)
        attn = self.backend.xp.empty(q.shape, dtype=q.dtype)
        if plan.rows is not None:
            attn[plan.rows] = self._batched(q[plan.rows], kl, vl, plan)
        self._attend(i, q, kl, vl, plan.others, attn)
        return attn

    def _batched(self, q, kl, vl, plan: "AttentionPlan"):
        return self.backend.decode(q, kl, vl, plan.batch, self.scale)  # one launch for all

    def _attend(self, i: int, q, kl, vl, spans: list[tuple[Span, object]], attn):
        """Attention of each span's rows through its own table (or the KV policy's per-kv-head
        tables; with its extra keys and attention mass, a soft-cap, a sliding window where they
        apply), into attn."""
        xp, cfg = self.backend.xp, self.cfg
        opts = {"softcap": cfg.attn_softcap} if cfg.attn_softcap else {}
        if i in self.local:
            opts["window"] = cfg.sliding_window
        for sp, table in spans:
            rows = slice(sp.start, sp.start + sp.length)
            ex, n_ctx, extra, by_position = sp.extras, sp.n_ctx, None, {}
            if ex is not None and ex.positioned is not None and self.positioned:
                at = ex.positioned(i, q[rows])
                table, n_ctx, extra, by_position = at.tables, at.n_ctx, at.extra, {"head_tables": True}
            elif ex is not None and ex.kv is not None:
                extra = ex.kv(i, q[rows])
            if extra is not None:
                extra = tuple(xp.asarray(a, dtype=layer.dtype) for a, layer in zip(extra, (kl, vl)))
            mass = None if ex is None or ex.mass is None else ex.mass[i]
            attn[rows] = self.backend.paged_attention(
                q[rows], kl, vl, table, n_ctx, self.scale, mass, extra, **opts, **by_position
            )

    def _decode_batch(self, spans: list[Span]):
        """The backend's batch of single-token spans for its one-launch decode, when it has one."""
        if not self.backend.caps.batched_decode:
            return None
        return self.backend.decode_batch([sp.block_table for sp in spans], [sp.n_ctx for sp in spans])


@dataclass(slots=True)
class AttentionPlan:
    """Llama._plan's answer. rows: where the batched spans' rows are in the pass (None when
    they are all of it); batch: the backend's decode_batch of them; others: (span, frozen
    table) each."""

    rows: object
    batch: object
    others: list
