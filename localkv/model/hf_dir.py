"""Load a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) in place:
F32/F16/BF16 tensors are read-only views of the mapped files (BF16 as its uint16 bits), never
converted on disk. Q/K rows are in Hugging Face order: NEOX RoPE.
"""

import hashlib
import json
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from localkv.backends.cpu.quant import QTensor
from localkv.errors import ModelError
from localkv.model.config import ModelConfig
from localkv.model.validate import MAX_CONTEXT, MAX_HEADS, MAX_LAYERS, Meta, check_heads, check_tensors
from localkv.model.weights import layout, vector

MAX_HEADER = 100 << 20  # a safetensors JSON header; real ones are a few hundred KB
_DTYPES = {"F32": ("F32", np.float32), "F16": ("F16", np.float16), "BF16": ("BF16", np.uint16)}
_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
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
_BUFFERS = ("rotary_emb.inv_freq",)  # saved by old transformers versions; recomputed from rope_theta


def load_hf_dir(path: Path) -> tuple[ModelConfig, dict, object]:
    from localkv.model.tokenizer import Tokenizer

    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: cannot read config.json ({e})") from None
    if not isinstance(hf, dict):
        raise ModelError(f"{path}: config.json is not a JSON object")
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    if hf.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        raise ModelError(f"{path.name}: unsupported architecture {archs[0]!r} (localkv runs llama-architecture models)")
    files = sorted(path.glob("*.safetensors"))
    if not files or not (path / "tokenizer.json").exists():
        raise ModelError(f"{path}: a model directory needs config.json, *.safetensors and tokenizer.json")
    tensors, h = {}, hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        for name, t in map_safetensors(f).items():
            if name.endswith(_BUFFERS):
                continue
            if name.startswith("model.layers."):
                _, _, i, rest = name.split(".", 3)
                name = f"blk.{i}.{_LAYER.get(rest, rest)}"
            tensors[_NAMES.get(name, name)] = t
    if hf.get("tie_word_embeddings", True):
        tensors.pop("output.weight", None)  # tied: the output matrix is the embedding
    cfg = _config(hf, path, tensors)
    cfg.fingerprint, cfg.file_size = h.hexdigest(), sum(f.stat().st_size for f in files)
    check_tensors(cfg, {n: t[1] for n, t in tensors.items()}, path.name)
    tok = Tokenizer.from_hf_dir(path)
    weights = layout(lambda name: _tensor(*tensors[name]), cfg, lambda name: name in tensors)
    cfg.tied_embeddings = "output" not in weights
    return cfg, weights, tok


def _config(hf: dict, path: Path, tensors: dict) -> ModelConfig:
    m = Meta(hf, f"{path.name}/config.json")
    dim = m.integer("hidden_size")
    n_heads = m.integer("num_attention_heads", hi=MAX_HEADS)
    if hf.get("head_dim") is None and dim % n_heads:
        raise m.fail("num_attention_heads", n_heads, f"does not divide hidden_size {dim}")
    emb = tensors.get("token_embd.weight")
    vocab = m.integer("vocab_size")
    dtype = str(hf.get("torch_dtype", "float32"))
    cfg = ModelConfig(
        name=path.name,
        n_layers=m.integer("num_hidden_layers", hi=MAX_LAYERS),
        dim=dim,
        ffn_dim=m.integer("intermediate_size"),
        n_heads=n_heads,
        n_kv_heads=m.integer("num_key_value_heads", n_heads, hi=MAX_HEADS),
        vocab_size=vocab if emb is None else emb[1][0],  # check_tensors compares the two
        ctx_len=m.integer("max_position_embeddings", 2048, hi=MAX_CONTEXT),
        rope_theta=m.number("rope_theta", 10000.0, 0.0, float("inf")),
        rms_eps=m.number("rms_norm_eps", 1e-5, 0.0, 1.0),
        head_dim=m.integer("head_dim", dim // n_heads),
        bos_id=hf.get("bos_token_id") if isinstance(hf.get("bos_token_id"), int) else None,
        eos_id=hf.get("eos_token_id") if isinstance(hf.get("eos_token_id"), int) else None,
        quant=dtype.upper().replace("BFLOAT", "BF").replace("FLOAT", "F"),
        n_params=sum(int(np.prod(t[1])) for t in tensors.values()),
        rope_style="neox",
    )
    if emb is not None and emb[1][0] != vocab:
        raise m.fail("vocab_size", vocab, f"differs from the {emb[1][0]} rows of the embedding")
    check_heads(cfg, path.name)
    return cfg


def _tensor(data: np.ndarray, shape: tuple, qtype: str):
    if len(shape) == 1:
        return vector(data)
    return QTensor(data, qtype, shape)


def map_safetensors(path: Path) -> dict[str, tuple[np.ndarray, tuple, str]]:
    """name -> (read-only view of the mapped file, shape, qtype) for each tensor, every header
    field checked against the file's size before a view is made."""
    fail = _failer(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 2 <= n <= min(MAX_HEADER, size - 8):
                raise fail(f"header length {n} does not fit the file's {size} bytes")
            header = json.loads(f.read(n))
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelError(f"{path.name}: cannot read the safetensors file ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise fail(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise fail("its header is not a JSON object")
    header.pop("__metadata__", None)
    out, base = {}, 8 + n
    for name, info in header.items():
        data, shape, qtype = _entry(name, info, size - base, fail)
        start = base + info["data_offsets"][0]
        out[name] = (np.frombuffer(mm, data, int(np.prod(shape)), start).reshape(shape), shape, qtype)
    return out


def _entry(name: str, info, room: int, fail) -> tuple:
    if not isinstance(info, dict) or not isinstance(info.get("shape"), list) or not isinstance(info.get("dtype"), str):
        raise fail(f"tensor {name!r} has no dtype and shape")
    kind = _DTYPES.get(info["dtype"])
    if kind is None:
        raise fail(f"tensor {name!r} is {info['dtype']}, which localkv cannot compute on (it runs F32, F16, BF16)")
    shape = info["shape"]
    if not 1 <= len(shape) <= 2 or not all(isinstance(d, int) and 0 < d < 1 << 40 for d in shape):
        raise fail(f"tensor {name!r} has shape {shape}: localkv reads 1- and 2-D tensors only")
    offs = info.get("data_offsets")
    nbytes = int(np.prod(shape)) * np.dtype(kind[1]).itemsize
    if (
        not isinstance(offs, list)
        or len(offs) != 2
        or not all(isinstance(o, int) for o in offs)
        or not 0 <= offs[0] <= offs[1] <= room
        or offs[1] - offs[0] != nbytes
    ):
        raise fail(f"tensor {name!r}: data offsets {offs} do not hold its {nbytes} bytes within the file")
    return kind[1], tuple(shape), kind[0]


def _failer(path: Path):
    def fail(msg: str) -> ModelError:
        return ModelError(f"{path.name}: corrupt safetensors file: {msg}")

    return fail
