"""The tokenizer metadata of the GGUFs scripts/make_model.py writes: each family's real
vocabulary (from scripts/fetch_vocab.py's cache, or the real SmolLM2 GGUF) converted the way
llama.cpp's convert_hf_to_gguf.py converts it, so llama.cpp reads these files as it reads the
models people download.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import fetch_vocab

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space


@dataclass(slots=True)
class Vocab:
    """The tokenizer.* metadata of a GGUF: tokens and their types, optional scores and merges."""

    model: str  # "gpt2" or "llama"
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    ids: dict[str, int] = field(default_factory=dict)  # bos/eos/unknown/padding -> id
    flags: dict[str, bool] = field(default_factory=dict)  # add_bos_token, add_eos_token, add_space_prefix
    chat_template: str | None = None

    def pad(self, n: int) -> None:
        if n < len(self.tokens):
            self.tokens, self.types = self.tokens[:n], self.types[:n]  # ids past the model's rows (Gemma 3)
            self.scores = self.scores[:n] if self.scores else None
        for i in range(len(self.tokens), n):
            self.tokens.append(f"[PAD{i}]")
            self.types.append(UNUSED)
            if self.scores is not None:
                self.scores.append(-10000.0)


def _looks_special(t: str) -> bool:  # convert_hf_to_gguf's does_token_look_special
    wrapped = (t.startswith("<|") and t.endswith("|>")) or (t.startswith("<｜") and t.endswith("｜>"))
    return wrapped or t in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (t.startswith("<unused") and t.endswith(">"))


def _hf_vocab(folder: Path, model: str, pre: str, drop: tuple[str, ...] = ()) -> Vocab:
    """A Hugging Face tokenizer.json as convert_hf_to_gguf.py writes it into a GGUF."""
    tj = json.loads((folder / "tokenizer.json").read_text())
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    added = {a["id"]: a for a in tj["added_tokens"] if a["content"] not in drop}
    by_id = {i: t for t, i in tj["model"]["vocab"].items()} | {i: a["content"] for i, a in added.items()}
    n = max(by_id) + 1
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n)]
    types = []
    for i, t in enumerate(tokens):
        if i in added:
            special = added[i]["special"] or _looks_special(t)
            types.append(CONTROL if special else USER_DEFINED)
            if not special:  # llama.cpp matches user-defined tokens against raw text: spaces, not U+2581
                tokens[i] = t.replace(SPACE, " ")
        elif i not in by_id:
            types.append(UNUSED)
        elif model == "llama" and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            types.append(BYTE)
        else:
            types.append(NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]

    def tid(key: str) -> int | None:
        tok = cfg.get(key)
        tok = tok.get("content") if isinstance(tok, dict) else tok
        return tokens.index(tok) if tok in tokens else None

    ids = {k: tid(f"{k}_token") for k in ("bos", "eos", "unk", "pad")}
    ids = {("unknown" if k == "unk" else "padding" if k == "pad" else k): v for k, v in ids.items() if v is not None}
    if model == "llama" and "unknown" in ids:
        types[ids["unknown"]] = UNKNOWN
    add_bos = cfg.get("add_bos_token")
    if add_bos is None:  # as gguf's SpecialVocab: BOS among the post-processor's special tokens
        add_bos = "bos" in ids and ids["bos"] in _template_ids(tj)
    flags = {"add_bos_token": bool(add_bos), "add_eos_token": bool(cfg.get("add_eos_token", False))}
    vocab = Vocab(model, pre, tokens, types, None, None, ids, flags, cfg.get("chat_template"))
    if model == "gpt2":
        vocab.merges = merges
    else:
        vocab.scores = _spm_scores(tokens, types, merges)
        for i in added:
            vocab.scores[i] = -1000.0  # as convert_hf_to_gguf scores added tokens
    return vocab


def _template_ids(tj: dict) -> set[int]:
    text = json.dumps(tj.get("post_processor") or {})
    return {int(i) for i in re.findall(r'"ids": \[(\d+)\]', text)}


def _spm_scores(tokens: list[str], types: list[int], merges: list[str]) -> list[float]:
    """SentencePiece scores rebuilt from the merge list: HF's converter orders the merges by the
    merged piece's score, so the earlier a piece is first formed, the higher its score.
    Pieces no merge forms (characters, bytes, specials) score 0, as in a .model file."""
    first: dict[str, int] = {}
    for rank, m in enumerate(merges):
        a, _, b = m.partition(" ")
        first.setdefault(a + b, rank)
    unreached = -float(len(merges))
    scores = [
        -float(first[t]) if t in first else (unreached - i if ty == NORMAL and len(t) > 1 else 0.0)
        for i, (t, ty) in enumerate(zip(tokens, types))
    ]
    return _whitespace_runs_last(tokens, types, scores)


def _whitespace_runs_last(tokens: list[str], types: list[int], scores: list[float]) -> list[float]:
    """SentencePiece gives its whitespace-run pieces one score of -1e9 (Llama 2's .model does; HF's
    merge lists put them last), so equal runs merge left to right rather than by some rank."""
    return [-1e9 if ty == NORMAL and set(t) == {SPACE} else sc for t, ty, sc in zip(tokens, types, scores)]


def _gguf_vocab(path: Path) -> Vocab:
    """The tokenizer of an existing GGUF (llama.cpp's vocab files, or the real SmolLM2)."""
    from localkv.model.tokenizer_gguf import read_metadata

    meta = read_metadata(path)
    get = lambda k: meta.get(f"tokenizer.{k}")  # noqa: E731
    ids = {k: get(f"ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")}
    flags = {k: get(f"ggml.{k}") for k in ("add_bos_token", "add_eos_token", "add_space_prefix")}
    return Vocab(
        get("ggml.model"), get("ggml.pre") or "default", list(get("ggml.tokens")), list(get("ggml.token_type")),
        get("ggml.scores"), get("ggml.merges"), {k: v for k, v in ids.items() if v is not None},
        {k: v for k, v in flags.items() if v is not None}, get("chat_template"),
    )  # fmt: skip


def _mistral_vocab(folder: Path, template: str) -> Vocab:
    """Mistral v0.3's SentencePiece pieces in id order: scores fall with the id (as Llama 2's real
    scores do), whitespace runs last."""
    pieces = json.loads((folder / "vocab.json").read_text())
    types = []
    for i, p in enumerate(pieces):
        if i == 0:
            types.append(UNKNOWN)
        elif i < 3 or (p.startswith("[") and p.endswith("]") and p.isupper() or p.startswith("[control_")):
            types.append(CONTROL)
        else:
            types.append(BYTE if len(p) == 6 and p.startswith("<0x") else NORMAL)
    scores = _whitespace_runs_last(pieces, types, [-float(i) if ty == NORMAL else 0.0 for i, ty in enumerate(types)])
    ids = {"unknown": 0, "bos": 1, "eos": 2}
    return Vocab("llama", "default", pieces, types, scores, None, ids, {"add_bos_token": True}, template)


def _smollm2_path() -> Path:
    from localkv.hub.pull import ensure_model

    return Path(ensure_model("smollm2-135m", progress=False))


QWEN3_ONLY = ("<tool_response>", "</tool_response>", "<think>", "</think>")  # added after Qwen2.5


def load_vocab(name: str, root: Path | None = None) -> Vocab:
    """A named vocabulary from the fetch_vocab cache (or the real SmolLM2 GGUF)."""
    root = root or fetch_vocab.cache_dir()
    family = vocab_family(name)
    if family is not None and not (root / family / "SOURCE.json").exists():
        raise FileNotFoundError(f"vocabulary {family!r} is not fetched: run python scripts/fetch_vocab.py {family}")
    templates = root / "llama.cpp" / "templates"
    read = lambda f: (templates / f).read_text() if (templates / f).exists() else None  # noqa: E731
    if name == "llama3":
        return _hf_vocab(root / "llama3", "gpt2", "llama-bpe")
    if name == "qwen3":
        return _hf_vocab(root / "qwen3", "gpt2", "qwen2")
    if name == "r1-distill":  # DeepSeek-R1's Qwen distills: Qwen's BPE, <think> tokens, R1's template
        v = _hf_vocab(root / "qwen3", "gpt2", "qwen2")
        v.chat_template = read("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")
        if v.chat_template is None:
            raise FileNotFoundError("R1's distill template is not fetched: run python scripts/fetch_vocab.py llama.cpp")
        return v
    if name == "qwen2.5":  # the same BPE as Qwen3, without Qwen3's four added tokens
        v = _hf_vocab(root / "qwen3", "gpt2", "qwen2", drop=QWEN3_ONLY)
        v.chat_template = read("Qwen-Qwen2.5-7B-Instruct.jinja") or v.chat_template
        return v
    if name in ("gemma2", "gemma3", "mistral-v1"):
        v = _hf_vocab(root / name, "llama", "default")
        if name.startswith("gemma"):
            v.flags["add_space_prefix"] = False  # as convert_hf_to_gguf writes for Gemma
        return v
    if name == "llama2":  # Llama 2 / TinyLlama, converted by llama.cpp from Meta's tokenizer.model
        return _gguf_vocab(root / "llama.cpp" / "ggml-vocab-llama-spm.gguf")
    if name == "phi3":
        v = _gguf_vocab(root / "llama.cpp" / "ggml-vocab-phi-3.gguf")
        v.chat_template = read("microsoft-Phi-3.5-mini-instruct.jinja") or v.chat_template
        return v
    if name == "mistral":
        return _mistral_vocab(root / "mistral", read("mistralai-Mistral-Nemo-Instruct-2407.jinja"))
    if name == "smollm2":
        return _gguf_vocab(_smollm2_path())
    raise KeyError(f"unknown vocabulary {name!r}")


def vocab_family(name: str) -> str | None:
    """The fetch_vocab family a vocabulary comes from (None: the real SmolLM2 from PyPI)."""
    families = {"qwen2.5": "qwen3", "r1-distill": "qwen3", "phi3": "llama.cpp", "llama2": "llama.cpp", "smollm2": None}
    return families.get(name, name)


def vocab_stamp(name: str) -> str:
    family = vocab_family(name)
    marker = fetch_vocab.cache_dir() / str(family) / "SOURCE.json"
    return marker.read_text() if family and marker.exists() else name
