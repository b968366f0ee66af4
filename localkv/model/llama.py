"""Llama forward pass over a flattened batch of sequences, K/V read and written only
through the block pool."""

from dataclasses import dataclass

import numpy as np

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
    extras: AttendExtras | None = None  # the KV policy's extra keys and attention-mass array, if any


ROPE_POSITIONS = 4096  # RoPE table rows made at start; more as positions are used


class Llama:
    """The forward pass, written once in the backend's op set (localkv/backends/base.py)."""

    def __init__(self, cfg: ModelConfig, weights: dict, ops):
        self.cfg, self.w, self.ops = cfg, weights, ops
        self.cos = self.sin = ops.xp.empty((0, cfg.head_dim // 2), np.float32)
        self.ensure_positions(min(cfg.ctx_len, ROPE_POSITIONS))
        self.scale = float(1.0 / np.sqrt(cfg.head_dim))
        # the output matrix [vocab, dim], stored [out, in] like every other: the embedding when tied
        self.w_out = weights.get("output", weights["tok_embd"])
        # the backend's rope takes a style only where it differs from its default (NEOX)
        self.rope_style = () if cfg.rope_style == "neox" else (cfg.rope_style,)

    def ensure_positions(self, n: int):
        """RoPE tables for positions up to n: grown as positions are used (a model's context may
        be millions of tokens), and past the context too (eviction lets a sequence run on)."""
        if n > len(self.cos):
            cfg, extra = self.cfg, {}
            if cfg.rope_freq_factors is not None:
                extra["factors"] = cfg.rope_freq_factors
            self.cos, self.sin = self.ops.rope_tables(cfg.head_dim, max(n, 2 * len(self.cos)), cfg.rope_theta, **extra)

    def _shared_prefix(self, spans: list[Span], block_size: int):
        """(prefix table, [(tail table, tail tokens)]) when every span is one decode token of a
        sequence sharing leading full blocks with all the others (and no policy needs the
        per-token attention mass); else None."""
        if len(spans) < 2 or not self.ops.shared_prefix or any(sp.length != 1 or sp.extras is not None for sp in spans):
            return None
        first = spans[0].block_table
        p = min(len(sp.block_table) for sp in spans)
        for sp in spans[1:]:
            same = np.flatnonzero(sp.block_table[:p] != first[:p])
            p = int(same[0]) if len(same) else p
        p = min(p, min((sp.n_ctx - 1) // block_size for sp in spans))  # prefix blocks are full, tails non-empty
        if p < 1:
            return None
        freeze = self.ops.frozen_table
        return freeze(first[:p]), self.ops.frozen_tails(
            [(freeze(sp.block_table[p:]), sp.n_ctx - p * block_size) for sp in spans]
        )

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
        cfg, w, ops = self.cfg, self.w, self.ops
        H, K, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        xp = ops.xp
        T = len(tokens)
        tokens, positions, slots = xp.asarray(tokens), xp.asarray(positions), xp.asarray(slots)
        ops.begin_forward(T)
        x = ops.embed(w["tok_embd"], tokens)
        cos, sin = self.cos[positions], self.sin[positions]
        shared = self._shared_prefix(spans, pool.block_size)
        batch = self._decode_batch(spans) if shared is None else None
        # one table per span as the backend reads it, made once for every layer
        tables = [ops.frozen_table(sp.block_table) for sp in spans] if shared is None and batch is None else None
        for i in range(cfg.n_layers):
            h = ops.rmsnorm(x, w[f"{i}.attn_norm"], cfg.rms_eps)
            qkv = ops.linear(h, w[f"{i}.wqkv"], "wqkv").reshape(T, H + 2 * K, hd)
            ops.rope(qkv[:, : H + K], cos, sin, *self.rope_style)
            q, k, v = qkv[:, :H], qkv[:, H : H + K], qkv[:, H + K :]
            kl, vl = pool.k[i], pool.v[i]
            ops.write_kv(kl, vl, slots, k, v)
            if shared is not None:  # forks of one prompt: the common prefix is scored once for all
                attn = ops.shared_prefix_decode(q, kl, vl, *shared, self.scale)
            elif batch is not None:  # single-token sequences: one launch for all of them
                attn = ops.decode(q, kl, vl, batch, self.scale)
            else:
                attn = xp.empty((T, H, hd), dtype=x.dtype)
                for sp, table in zip(spans, tables):
                    rows = slice(sp.start, sp.start + sp.length)
                    ex = sp.extras
                    extra = None if ex is None or ex.kv is None else ex.kv(i, q[rows])
                    if extra is not None:
                        extra = tuple(xp.asarray(a, dtype=kl.dtype) for a in extra)
                    mass = None if ex is None or ex.mass is None else ex.mass[i]
                    attn[rows] = ops.paged_attention(q[rows], kl, vl, table, sp.n_ctx, self.scale, mass, extra)
            x += ops.linear(attn.reshape(T, H * hd), w[f"{i}.wo"], "wo")
            h = ops.rmsnorm(x, w[f"{i}.ffn_norm"], cfg.rms_eps)
            x += ops.linear(ops.silu_mul(ops.linear(h, w[f"{i}.w_gate_up"], "w_gate_up")), w[f"{i}.w_down"], "w_down")
        h = ops.rmsnorm(x[xp.asarray(logit_rows)], w["out_norm"], cfg.rms_eps)
        return ops.logits(h, self.w_out)

    def _decode_batch(self, spans: list[Span]):
        """The backend's batch of single-token sequences for its one-launch decode, when it has
        one and no span needs extra keys or attention mass; else None."""
        if not self.ops.batched_decode or any(sp.length != 1 or sp.extras is not None for sp in spans):
            return None
        return self.ops.decode_batch([sp.block_table for sp in spans], [sp.n_ctx for sp in spans])
