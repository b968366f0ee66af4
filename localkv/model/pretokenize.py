"""Byte-level BPE as llama.cpp runs it: its pre-tokenizer regex list per `tokenizer.ggml.pre`,
expressed with the `tokenizers` library (one isolating Split per regex, then GPT-2's byte map).

llama.cpp applies each regex of a list in turn to the pieces the previous one left, keeping
both the matches and the text between them; a Split(..., "isolated") does exactly that.
"""

from __future__ import annotations

import itertools

import numpy as np
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from localkv.errors import ModelError

# The regexes of llama.cpp's src/llama-vocab.cpp (llm_tokenizer_bpe), in the tokenizer.json form
# that llama.cpp adapts for std::regex: (?i:...) here is what it spells as '[sS]|'[tT]...
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# (written with escapes: an editor's Unicode normalization would turn some range ends into other letters)
_DEEPSEEK_LATIN = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"


_LLAMA3_GROUP = "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano"


def _names(names: str, regexes: list[str]) -> dict[str, list[str]]:
    return dict.fromkeys(names.split(), regexes)


PRE_REGEXES: dict[str, list[str]] = {
    **_names("gpt-2 phi-2 mpt olmo jais trillion granite-docling exaone4 gigachat a.x-4.0 mellum", [_GPT2]),
    **_names("modern-bert jina-es jina-de jina-v2-es jina-v2-de", [_GPT2]),
    **_names("smollm starcoder refact command-r codeshell exaone minerva-7b mellum2", [r"\p{N}", _GPT2]),
    **_names(_LLAMA3_GROUP + " dbrx smaug-bpe", [_LLAMA3]),
    **_names("qwen2 deepseek-r1-qwen kormo f2llmv2 stablelm2 megrez hunyuan solar-open", [_QWEN2]),
    "qwen35": [_QWEN35],
    "falcon": [
        r"[\p{P}\$\+<=>\^~\|`]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"[0-9][0-9][0-9]",
    ],
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"],
    "deepseek-llm": [r"[\r\n]", _DEEPSEEK_LATIN, _DEEPSEEK_PUNCT, r"\s+$", _CJK, r"\p{N}+"],
    # llama.cpp's fallback when a GGUF names no pre-tokenizer (or 'default')
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
}
# llama.cpp's flags for the Llama 3 group: a word found whole in the vocab skips the merges; BOS by default
IGNORE_MERGES = ADD_BOS_DEFAULT = frozenset(_LLAMA3_GROUP.split())


def pre_name(pre: str | None) -> str:
    """The regex list llama.cpp uses for a GGUF's tokenizer.ggml.pre (missing means 'default')."""
    name = pre or "default"
    if name not in PRE_REGEXES:
        raise ModelError(
            f"unsupported pre-tokenizer {pre!r} (supported: {', '.join(sorted(PRE_REGEXES))}): "
            "this model's tokenizer is not implemented yet"
        )
    return name


def byte_decoder() -> dict[str, int]:
    """GPT-2's printable-char -> byte table (inverse of bytes_to_unicode)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    table = {chr(b): b for b in keep}
    table.update({chr(256 + i): b for i, b in enumerate(extra)})
    return table


def _latin1_of_bytes() -> dict[int, str]:
    """A str.translate table: each byte char -> the latin-1 char of its byte value; a char below
    256 outside the table whose UTF-8 is not its latin-1 byte -> U+FFFF, which latin-1 cannot
    encode (so bytelevel_bytes takes its exact path)."""
    trans = {ord(c): chr(b) for c, b in byte_decoder().items()}
    return trans | {i: "\uffff" for i in range(128, 256) if i not in trans}


_LATIN1 = _latin1_of_bytes()


def bytelevel_bytes(piece: str, table: dict[str, int]) -> bytes:
    try:  # one C pass for a whole piece (a vocabulary's worth at every start)
        return piece.translate(_LATIN1).encode("latin-1")
    except UnicodeEncodeError:
        # A char outside the table cannot come from byte-level BPE; keep it as UTF-8 rather than drop it.
        return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)


def _byte_of_char() -> np.ndarray:
    """_LATIN1 and its latin-1 encoding as one lookup over code points (the table's chars are
    below U+0144): the byte a char becomes, or -1 where bytelevel_bytes takes its exact path."""
    lut = np.full(512, -1, np.int16)
    for i in range(len(lut)):
        c = _LATIN1.get(i, chr(i))
        if ord(c) < 256:
            lut[i] = ord(c)
    return lut


_BYTE_OF_CHAR = _byte_of_char()


def bytelevel_all(pieces: list[str]) -> list[bytes] | None:
    """bytelevel_bytes of every piece, looked up for the whole vocabulary at once (each char is
    one byte, so each piece keeps its length); None when a piece has a char outside the table
    (bytelevel_bytes then takes it piece by piece)."""
    cps = np.frombuffer("".join(pieces).encode("utf-32-le"), np.uint32)
    if len(cps) and int(cps.max()) >= len(_BYTE_OF_CHAR):
        return None
    values = _BYTE_OF_CHAR[cps]
    if (values < 0).any():
        return None
    joined = values.astype(np.uint8).tobytes()
    ends = list(itertools.accumulate(map(len, pieces)))
    return [joined[a:b] for a, b in zip([0, *ends], ends)]


def _with_byte_placeholders(ids: dict[str, int], n: int) -> dict[str, int]:
    """The BPE vocab (text -> id of n tokens), plus ids past its end for byte chars it lacks
    (SmolLM2 lacks 21).

    llama.cpp keeps such a byte as a symbol that no merge can cross, then drops it;
    HF's BPE would drop it first and merge its neighbours. A placeholder keeps the
    barrier, and the caller filters the placeholder ids out.
    """
    extra = [c for c in byte_decoder() if c not in ids]
    return ids | {c: n + i for i, c in enumerate(extra)}


def bpe_model(ids: dict[str, int], n: int, merges: list[str], pre: str) -> HFTokenizer:
    """An HF BPE tokenizer over a vocabulary of n tokens (text -> id) that splits text the way
    llama.cpp's pre type `pre` does."""
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(_with_byte_placeholders(ids, n), pairs, ignore_merges=pre in IGNORE_MERGES)
    hf = HFTokenizer(bpe)
    splits = [pre_tokenizers.Split(Regex(rx), "isolated") for rx in PRE_REGEXES[pre]]
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return hf
