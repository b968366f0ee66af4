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


def write_gguf(path: Path, quant: str = "F32", ctx: int = 256, seed: int = 0, arch: str = "llama", **kw) -> Path:
    import gguf
    from gguf.quants import quantize

    w, hp = tiny_weights(seed, **kw)
    qtype = gguf.GGMLQuantizationType[quant]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-test")
    writer.add_block_count(hp["n_layers"])
    writer.add_context_length(ctx)
    writer.add_embedding_length(hp["dim"])
    writer.add_feed_forward_length(hp["ffn"])
    writer.add_head_count(hp["n_heads"])
    writer.add_head_count_kv(hp["n_kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(hp["vocab"])
    writer.add_rope_dimension_count(hp["dim"] // hp["n_heads"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    vocab = byte_vocab()
    writer.add_token_list(vocab)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    for name, a in w.items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            key = rest.rsplit(".", 1)[0]
            if key == "self_attn.q_proj":
                a = _permute(a, hp["n_heads"])
            elif key == "self_attn.k_proj":
                a = _permute(a, hp["n_kv_heads"])
            gname = f"blk.{i}.{_GGUF_NAMES[key]}.weight"
        else:
            gname = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        if a.ndim == 2 and quant != "F32":
            writer.add_tensor(gname, quantize(a, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gname, a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
