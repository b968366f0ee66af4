"""Small random-weight Llama models written by the tests: a GGUF file (llama.cpp layout,
any supported quant) and the same weights as a Hugging Face directory."""

import json
from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_vocab() -> list[str]:
    """Specials first (ids 0..2, as SmolLM2), then GPT-2's 256 byte symbols: a valid byte-level BPE
    vocabulary with no merges."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(extra)}
    return SPECIALS + [table[b] for b in range(256)] + ["Ġt", "he"]


MERGES = ["Ġ t", "h e"]


def tiny_weights(seed=0, n_layers=2, dim=64, ffn=96, n_heads=4, n_kv_heads=2, vocab=261, tied=True):
    """HF-named fp32 weights, Hugging Face row order for q/k."""
    rng = np.random.default_rng(seed)

    def mat(o, i):
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    hd = dim // n_heads
    w = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, dim)).astype(np.float32),
        "model.norm.weight": (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32),
    }
    if not tied:
        w["lm_head.weight"] = mat(vocab, dim)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
        w[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
        w[p + "self_attn.q_proj.weight"] = mat(n_heads * hd, dim)
        w[p + "self_attn.k_proj.weight"] = mat(n_kv_heads * hd, dim)
        w[p + "self_attn.v_proj.weight"] = mat(n_kv_heads * hd, dim)
        w[p + "self_attn.o_proj.weight"] = mat(dim, n_heads * hd)
        w[p + "mlp.gate_proj.weight"] = mat(ffn, dim)
        w[p + "mlp.up_proj.weight"] = mat(ffn, dim)
        w[p + "mlp.down_proj.weight"] = mat(dim, ffn)
    hp = dict(n_layers=n_layers, dim=dim, ffn=ffn, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab=vocab)
    return w, hp


def _permute(w, n_head):
    """Hugging Face q/k rows -> llama.cpp's pairwise-RoPE order (what convert_hf_to_gguf does)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


# Types gguf-py cannot quantize are written as random blocks (read_back gives their values).
# Byte offsets of a block's fp16 scales (d, and dmin where there is one), as ggml lays them out:
# set so the weights come out about the size of the fp32 ones.
_BLOCK_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _metadata(arch: str, hp: dict, ctx: int) -> dict:
    """key -> value of a valid tiny model (types as write_gguf infers them)."""
    vocab = byte_vocab()
    return {
        "general.name": "tiny-test",
        f"{arch}.block_count": hp["n_layers"],
        f"{arch}.context_length": ctx,
        f"{arch}.embedding_length": hp["dim"],
        f"{arch}.feed_forward_length": hp["ffn"],
        f"{arch}.attention.head_count": hp["n_heads"],
        f"{arch}.attention.head_count_kv": hp["n_kv_heads"],
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.vocab_size": hp["vocab"],
        f"{arch}.rope.dimension_count": hp["dim"] // hp["n_heads"],
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": vocab,
        "tokenizer.ggml.token_type": [3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)),
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }


def _add(writer, key: str, v):
    from gguf import GGUFValueType as T

    def typ(x):
        if isinstance(x, bool):
            return T.BOOL
        if isinstance(x, int):
            return T.INT32 if x < 0 else T.UINT32 if x < 1 << 32 else T.UINT64
        return T.FLOAT32 if isinstance(x, float) else T.STRING

    if isinstance(v, list):  # numbers as llama.cpp's writer stores them: int32 token types
        sub = T.STRING if v and isinstance(v[0], str) else T.FLOAT32 if v and isinstance(v[0], float) else T.INT32
        writer.add_key_value(key, v, T.ARRAY, sub)
    else:
        writer.add_key_value(key, v, typ(v))


def random_blocks(qtype: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random but valid blocks [rows, row bytes] of a block type, weights about 1/sqrt(cols)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    t = GGMLQuantizationType[qtype]
    values, nbytes = GGML_QUANT_SIZES[t]
    data = rng.integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)
    offsets = _BLOCK_SCALES.get(qtype, ())
    for scale in (1.0, None) if offsets else ():
        if scale is None:
            std = float(dequantize(data.reshape(rows, -1), t).std())
            scale = 1.0 / np.sqrt(cols) / std
        for off in offsets:
            data[..., off : off + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    return data.reshape(rows, -1)


def write_gguf(
    path: Path,
    quant: str = "F32",
    ctx: int = 256,
    seed: int = 0,
    arch: str = "llama",
    meta: dict | None = None,
    types: dict | None = None,
    drop: tuple = (),
    extra: dict | None = None,
    **kw,
) -> Path:
    """A tiny llama GGUF, matrices of type `quant` (gguf-py's quantizer, or random blocks for the
    K-quants). meta: keys to change (None removes one); types: tensor -> another type (random
    blocks); drop: tensors to leave out; extra: more F32 tensors by name (e.g. rope_freqs.weight)."""
    import gguf
    from gguf.quants import quantize

    w, hp = tiny_weights(seed, **kw)
    rng = np.random.default_rng(seed + 100)
    writer = gguf.GGUFWriter(str(path), arch)
    for key, v in (_metadata(arch, hp, ctx) | (meta or {})).items():
        if v is not None:
            _add(writer, key, v)
    for name, a in w.items():
        gname = gguf_name(name)
        if gname in drop:
            continue
        if name.endswith("q_proj.weight"):
            a = _permute(a, hp["n_heads"])
        elif name.endswith("k_proj.weight"):
            a = _permute(a, hp["n_kv_heads"])
        qname = (types or {}).get(gname, quant if a.ndim == 2 else "F32")
        if qname == "F32":
            writer.add_tensor(gname, a)
        elif qname in _BLOCK_SCALES or gname in (types or {}):
            qtype = gguf.GGMLQuantizationType[qname]
            writer.add_tensor(gname, random_blocks(qname, *a.shape, rng), raw_dtype=qtype)
        else:
            qtype = gguf.GGMLQuantizationType[qname]
            writer.add_tensor(gname, quantize(a, qtype), raw_dtype=qtype)
    for gname, a in (extra or {}).items():
        writer.add_tensor(gname, np.asarray(a, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, i, rest = hf_name.split(".", 3)
        return f"blk.{i}.{_GGUF_NAMES[rest.rsplit('.', 1)[0]]}.weight"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf_name]


def read_back(path: Path, seed: int = 0, **kw) -> dict:
    """The HF-named float64 weights a GGUF written by write_gguf really holds (gguf-py's
    dequantizer, Q/K rows back in Hugging Face order): the reference for any type."""
    import gguf
    from gguf.quants import dequantize

    w, hp = tiny_weights(seed, **kw)
    r = gguf.GGUFReader(path)
    by_name = {t.name: t for t in r.tensors}
    out = {}
    for name in w:
        t = by_name[gguf_name(name)]
        a = np.asarray(dequantize(t.data, t.tensor_type), np.float64).reshape(w[name].shape)
        if name.endswith("q_proj.weight"):
            a = _unpermute(a, hp["n_heads"])
        elif name.endswith("k_proj.weight"):
            a = _unpermute(a, hp["n_kv_heads"])
        out[name] = a
    return out


def _unpermute(w, n_head):
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_hf_dir(path: Path, seed: int = 0, ctx: int = 256, **kw) -> Path:
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    w, hp = tiny_weights(seed, **kw)
    path.mkdir(parents=True, exist_ok=True)
    save_file(w, str(path / "model.safetensors"))
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "num_hidden_layers": hp["n_layers"],
                "hidden_size": hp["dim"],
                "intermediate_size": hp["ffn"],
                "num_attention_heads": hp["n_heads"],
                "num_key_value_heads": hp["n_kv_heads"],
                "vocab_size": hp["vocab"],
                "max_position_embeddings": ctx,
                "rope_theta": 10000.0,
                "rms_norm_eps": 1e-5,
                "tie_word_embeddings": "lm_head.weight" not in w,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "torch_dtype": "float32",
            }
        )
    )
    vocab = byte_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[tuple(m.split()) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    )
    return path
