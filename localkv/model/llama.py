"""Llama forward pass over a flattened batch of sequences, K/V read and written only
through the block pool."""

from dataclasses import dataclass

import numpy as np

from localkv.backends import cpu as ops_numpy
from localkv.kv.block_pool import BlockPool
from localkv.model.config import ModelConfig

LOGIT_CHUNK = 1024  # vocabulary rows per matmul when few logits rows are wanted (see Llama._logits_rows)
LOGIT_CHUNK_MAX_ROWS = 64


@dataclass(slots=True)
class Span:
    """One sequence's rows in a batch: tokens [start, start+length) are the last
    `length` of its n_ctx-token context, stored through block_table."""

    start: int
    length: int
    block_table: np.ndarray
    n_ctx: int
    mass: np.ndarray | None = None  # h2o: [layers, kv_heads, n_extra + n_ctx] attention mass per key, if set
    retrieve: object = None  # h2o, offload: (layer, q [length, H, hd]) -> extra (K, V) [kvh, n_extra, hd] or None


class Llama:
    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray], ops=ops_numpy):
        self.cfg, self.w, self.ops = cfg, weights, ops
        self.cos, self.sin = ops.rope_tables(cfg.head_dim, cfg.ctx_len, cfg.rope_theta)
        self.scale = float(1.0 / np.sqrt(cfg.head_dim))
        self.output = weights["output"]
        # tied embeddings: tok_embd [V, D] is the output matrix transposed, already contiguous.
        # For several logits rows OpenBLAS runs tok_embd @ h.T faster than h @ output (8 rows:
        # 14.2 vs 18.5 ms); for one row, slower (4.8 vs 3.3 ms).
        emb = weights.get("tok_embd")
        self.output_t = (
            emb
            if cfg.tied_embeddings
            and ops.xp is np
            and emb is not None
            and emb.dtype == self.output.dtype
            and emb.flags.c_contiguous
            and emb.shape[::-1] == self.output.shape
            else None
        )

    def _logits_rows(self, h: np.ndarray) -> np.ndarray:
        """Logits for several rows h [R, D] as tok_embd @ h.T. Up to LOGIT_CHUNK_MAX_ROWS rows the
        vocabulary goes in slices of LOGIT_CHUNK rows (2.4 MB each, so the slice OpenBLAS packs stays
        in cache): 8 rows 11.0 vs 13.6 ms, 2 rows 7.5 vs 10.0 ms; at 256 rows one call is as fast."""
        emb, R = self.output_t, len(h)
        if R > LOGIT_CHUNK_MAX_ROWS:
            return np.ascontiguousarray((emb @ h.T).T, dtype=np.float32)
        hT = np.ascontiguousarray(h.T)
        out = np.empty((len(emb), R), np.float32)
        for i in range(0, len(emb), LOGIT_CHUNK):
            np.matmul(emb[i : i + LOGIT_CHUNK], hT, out=out[i : i + LOGIT_CHUNK])
        return np.ascontiguousarray(out.T)

    def ensure_positions(self, n: int):
        """RoPE tables for positions up to n (past the context: eviction lets a sequence run on)."""
        if n > len(self.cos):
            self.cos, self.sin = self.ops.rope_tables(self.cfg.head_dim, max(n, 2 * len(self.cos)), self.cfg.rope_theta)

    def _shared_prefix(self, spans: list[Span], block_size: int):
        """(prefix table, [(tail table, tail tokens)]) when every span is one decode token of a
        sequence sharing leading full blocks with all the others (and no policy needs the
        per-token attention mass); else None."""
        if (
            len(spans) < 2
            or not hasattr(self.ops, "shared_prefix_decode")
            or any(sp.length != 1 or sp.mass is not None or sp.retrieve is not None for sp in spans)
        ):
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
        x = w["tok_embd"][tokens].astype(ops.act_dtype, copy=False)  # indexing already copied
        cos, sin = self.cos[positions], self.sin[positions]
        shared = self._shared_prefix(spans, pool.block_size)
        # one read-only table per span, for every layer (ops_numpy checks it once)
        tables = [ops.frozen_table(sp.block_table) for sp in spans] if shared is None else None
        for i in range(cfg.n_layers):
            h = ops.rmsnorm(x, w[f"{i}.attn_norm"], cfg.rms_eps)
            qkv = ops.linear(h, w[f"{i}.wqkv"], "wqkv").reshape(T, H + 2 * K, hd)
            ops.rope(qkv[:, : H + K], cos, sin)
            q, k, v = qkv[:, :H], qkv[:, H : H + K], qkv[:, H + K :]
            kl, vl = pool.k[i], pool.v[i]
            ops.write_kv(kl, vl, slots, k, v)
            if shared is not None:  # forks of one prompt: the common prefix is scored once for all
                attn = ops.shared_prefix_decode(q, kl, vl, *shared, self.scale)
            else:
                attn = xp.empty((T, H, hd), dtype=x.dtype)
                for sp, table in zip(spans, tables):
                    rows = slice(sp.start, sp.start + sp.length)
                    extra = None if sp.retrieve is None else sp.retrieve(i, q[rows])
                    if extra is not None:
                        extra = tuple(xp.asarray(a, dtype=kl.dtype) for a in extra)
                    attn[rows] = ops.paged_attention(
                        q[rows], kl, vl, table, sp.n_ctx, self.scale, None if sp.mass is None else sp.mass[i], extra
                    )
            x += ops.linear(attn.reshape(T, H * hd), w[f"{i}.wo"], "wo")
            h = ops.rmsnorm(x, w[f"{i}.ffn_norm"], cfg.rms_eps)
            x += ops.linear(ops.silu_mul(ops.linear(h, w[f"{i}.w_gate_up"], "w_gate_up")), w[f"{i}.w_down"], "w_down")
        h = ops.rmsnorm(x[xp.asarray(logit_rows)], w["out_norm"], cfg.rms_eps)
        if self.output_t is not None and ops.uses_kernels(len(h)):
            return ops.linear(h, self.output_t, "output")
        if len(h) > 1 and self.output_t is not None:
            return self._logits_rows(h)
        return ops.to_host(h @ self.output).astype(np.float32, copy=False)
