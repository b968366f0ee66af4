"""What llama.cpp makes of a GGUF vocabulary besides the merges: each token's role (llama.cpp
overrides some of the file's token types by their text), the special tokens it cuts out of the
text, the end-of-generation set, and the BOS/EOS/space-prefix flags with their per-type defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from localkv.model.pretokenize import ADD_BOS_DEFAULT, byte_decoder, bytelevel_all, bytelevel_bytes
from localkv.model.tokenizer_spm import byte_piece_value, spm_piece_bytes

# GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp treats as end of generation (and forces to control type) whatever the file says.
EOG_TEXTS = frozenset(
    [
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<｜end▁of▁sentence｜>", "[e~[",
    ]
)  # fmt: skip
# Tokens llama.cpp looks up by key, else by text (a text match is forced to control type):
# EOT, EOM, and the fill-in-the-middle ones, of which pad, repo and file-separator also end generation.
_BY_TEXT = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
            "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
_GPT_OSS_USER = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # always rendered, as llama.cpp does


@dataclass(slots=True)
class Vocab:
    """A GGUF vocabulary as llama.cpp sees it after loading."""

    spm: bool  # SentencePiece-style ("llama") rather than byte-level BPE ("gpt2")
    tokens: list[str]
    kinds: list[int]  # per id: NORMAL, BYTE, CONTROL (incl. unknown), USER_DEFINED or UNUSED
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    stop_ids: set[int] = field(default_factory=set)
    rstrip: frozenset[int] = frozenset()  # specials that eat the whitespace after them (Phi-3)
    ids: dict[str, int] = field(init=False)  # text -> id (the last of equal texts)

    def __post_init__(self):
        self.ids = dict(zip(self.tokens, range(len(self.tokens))))

    def of_kinds(self, *kinds: int) -> list[dict[str, int]]:
        """For each of these kinds, its tokens' text -> id (one pass over the vocabulary)."""
        out: dict[int, dict[str, int]] = {k: {} for k in kinds}
        for i, k in enumerate(self.kinds):
            if k in out:
                out[k][self.tokens[i]] = i
        return [out[k] for k in kinds]

    def piece_bytes(self) -> list[bytes]:
        """Each token's text as llama.cpp's token_to_piece renders it (specials verbatim)."""
        table = byte_decoder()  # built once: a few hundred microseconds a call
        out = None if self.spm else bytelevel_all(self.tokens)  # right for every NORMAL token
        if out is None:
            return [self._piece(text, kind, table) for text, kind in zip(self.tokens, self.kinds)]
        for i in [i for i, kind in enumerate(self.kinds) if kind != NORMAL]:
            out[i] = self._piece(self.tokens[i], self.kinds[i], table)
        return out

    def _piece(self, text: str, kind: int, table: dict[str, int]) -> bytes:
        if kind in (CONTROL, USER_DEFINED):
            return text.encode()
        if kind == BYTE:
            value = byte_piece_value(text)
            return b"" if value is None else bytes([value])
        if kind == NORMAL:
            return spm_piece_bytes(text) if self.spm else bytelevel_bytes(text, table)
        return b""  # unused and undefined tokens render as nothing


# a file's token type -> the role llama.cpp gives it: unknown-type tokens parse and render like
# control ones, types it does not know as unused
_KINDS = {NORMAL: NORMAL, UNKNOWN: CONTROL, CONTROL: CONTROL, USER_DEFINED: USER_DEFINED, UNUSED: UNUSED, BYTE: BYTE}


def _token_id(meta: dict, key: str, n: int, default: int | None = None) -> int | None:
    """An id key as llama.cpp reads it: out-of-range values fall back to the default."""
    tid = meta.get(f"tokenizer.ggml.{key}_token_id")
    if tid is not None and 0 <= int(tid) < n:
        return int(tid)
    return default if default is not None and default < n else None


def vocab_from_gguf(meta: dict, spm: bool, pre: str, default_ids: bool = True) -> Vocab:
    """default_ids: fall back to llama.cpp's default BOS/EOS/UNK ids when the file names none."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * n
    kinds = [_KINDS.get(t, UNUSED) for t in types]  # a list of ints (the loader's _plain)
    get = meta.get
    # llama.cpp's defaults when the file has no id: SPM <s>=1 </s>=2 <unk>=0, BPE 11 for both
    dflt = dict(zip(("bos", "eos", "unknown"), (1, 2, 0) if spm else (11, 11, None)))
    bos, eos, unk = (_token_id(meta, key, n, d if default_ids else None) for key, d in dflt.items())
    add_bos = bool(get("tokenizer.ggml.add_bos_token", spm or pre in ADD_BOS_DEFAULT))
    add_eos = bool(get("tokenizer.ggml.add_eos_token", False))
    add_space_prefix = bool(get("tokenizer.ggml.add_space_prefix", spm))
    vocab = Vocab(spm, tokens, kinds, bos, eos, unk, add_bos, add_eos, add_space_prefix)
    _mark_end_of_generation(vocab, meta)
    name = str(get("general.name") or "").lower()
    if "phi-3" in name or "phi3" in name:  # llama.cpp's Phi-3 rule: specials strip the whitespace after them
        keep = {tokens.index(t) for t in ("<unk>", "<s>", "<|endoftext|>") if t in tokens}
        specials = {i for i, k in enumerate(kinds) if k in (CONTROL, USER_DEFINED)}
        vocab.rstrip = frozenset(specials - keep)
    return vocab


def _mark_end_of_generation(vocab: Vocab, meta: dict) -> None:
    """llama.cpp's special_eog_ids, and the token types it overrides on the way."""
    ids, kinds, n = vocab.ids, vocab.kinds, len(vocab.tokens)
    found: dict[str, int] = {}
    for key, texts in _BY_TEXT.items():
        tid = _token_id(meta, key, n)
        if tid is None:
            tid = next((ids[t] for t in texts if t in ids), None)
            if tid is not None:
                kinds[tid] = CONTROL
        if tid is not None:
            found[key] = tid
    stops = {found[k] for k in ("fim_pad", "fim_rep", "fim_sep") if k in found}
    for t in EOG_TEXTS & ids.keys():
        stops.add(ids[t])
        kinds[ids[t]] = CONTROL
    for t in _GPT_OSS_USER:
        if t in ids:
            kinds[ids[t]] = USER_DEFINED
    stops |= {i for i in (vocab.eos_id, found.get("eot"), found.get("eom")) if i is not None}
    texts = {vocab.tokens[i] for i in stops}
    calls = bool(texts & {"<|call|>", "<|calls|>"})
    if "<|end|>" in texts and calls and ("<|return|>" in texts or "<|flush|>" in texts):  # gpt-oss, solar-open
        stops.discard(ids["<|end|>"])
        kinds[ids["<|end|>"]] = USER_DEFINED
    if "</s>" in texts and texts & {"<|tool_response>", "<|plamo:eos|>"}:  # Gemma 4, PLaMo
        stops.discard(ids["</s>"])
        kinds[ids["</s>"]] = NORMAL
    vocab.stop_ids = stops
