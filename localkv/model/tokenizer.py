"""Text <-> token ids, matching llama.cpp's tokenizer for byte-level BPE models.

Encoding runs in two stages, like llama.cpp's `llama_tokenize`:
  1. special-token partition: control tokens (only when `special=True`) and
     user-defined tokens (always) are cut out of the text as whole tokens;
  2. every remaining text fragment goes through an HF `tokenizers` BPE model
     whose pre-tokenizer reproduces llama.cpp's regex list for the model.

Decoding maps each id to its raw bytes (byte-level pieces unmapped, special
tokens verbatim), so a streamer can hold back half a UTF-8 character.
"""

from __future__ import annotations

import codecs
import json
from functools import cached_property
from pathlib import Path

from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from localkv.errors import ModelError

# GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

# llama.cpp (llama-vocab.cpp) pre-tokenizer regex lists, by tokenizer.ggml.pre.
# ByteLevel(use_regex=True) applies exactly the GPT-2 regex, so each list is
# expressed as "extra isolating splits, then ByteLevel". Other pre types (llama.cpp's
# 'default' included) use different regexes and are refused rather than tokenized wrongly.
_PRE_SPLITS = {
    **dict.fromkeys(["gpt-2", "phi-2", "mpt", "olmo", "jais"], []),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"], [r"\p{N}"]),
}

# Tokens that end a turn in common chat formats (llama.cpp treats them as end-of-generation too).
_END_OF_TURN = {
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<EOT>",
    "<end_of_utterance>",
}

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-char -> byte table (inverse of bytes_to_unicode)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    table = {chr(b): b for b in keep}
    table.update({chr(256 + i): b for i, b in enumerate(extra)})
    return table


def _bytelevel_bytes(piece: str, table: dict[str, int]) -> bytes:
    # A char outside the table cannot come from byte-level BPE; keep it as UTF-8 rather than drop it.
    return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)


def _with_byte_placeholders(tokens: list[str]) -> dict[str, int]:
    """The BPE vocab, plus ids past its end for byte chars it lacks (SmolLM2 lacks 21).

    llama.cpp keeps such a byte as a symbol that no merge can cross, then drops it;
    HF's BPE would drop it first and merge its neighbours. A placeholder keeps the
    barrier, and encode() filters the placeholder ids out.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    extra = [c for c in _byte_decoder() if c not in vocab]
    return vocab | {c: len(tokens) + i for i, c in enumerate(extra)}


class Tokenizer:
    """A model's tokenizer: encode/decode, streaming decode and chat-template rendering."""

    def __init__(
        self,
        hf: HFTokenizer,
        token_bytes: list[bytes],
        control: dict[str, int],
        user_defined: dict[str, int],
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        chat_template: str | None,
        extra_stop_ids: tuple[int, ...] = (),
    ):
        self._hf = hf
        self._token_bytes = token_bytes
        self._control = control  # text -> id, parsed only when special=True
        self._user_defined = user_defined  # text -> id, always parsed (llama.cpp and HF agree)
        self._control_ids = frozenset(control.values())
        # Partition order: longest token text first, as llama.cpp sorts its special-token cache.
        by_length = lambda d: sorted(d.items(), key=lambda kv: -len(kv[0]))  # noqa: E731
        self._parse_special = by_length({**control, **user_defined})
        self._parse_plain = by_length(user_defined)
        self.vocab_size = len(token_bytes)
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.chat_template = chat_template
        turn_ends = {i for t, i in control.items() if t in _END_OF_TURN}
        self.stop_ids: set[int] = {i for i in (eos_id, *extra_stop_ids) if i is not None} | turn_ends

    # ---- construction -------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        import gguf

        try:
            reader = gguf.GGUFReader(str(path))
        except Exception as e:  # gguf raises bare ValueError/struct errors on corrupt files
            raise ModelError(f"cannot read GGUF file {path}: {e}") from e
        return cls.from_gguf_metadata({k: f.contents() for k, f in reader.fields.items()})

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
        if kind != "gpt2":
            raise ModelError(f"unsupported tokenizer model {kind!r} (only byte-level BPE 'gpt2' is supported)")
        if pre not in _PRE_SPLITS:
            raise ModelError(f"unsupported pre-tokenizer {pre!r} (supported: {', '.join(sorted(_PRE_SPLITS))})")
        tokens = meta["tokenizer.ggml.tokens"]
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]

        hf = HFTokenizer(models.BPE(_with_byte_placeholders(tokens), merges))
        isolate = [pre_tokenizers.Split(Regex(rx), "isolated") for rx in _PRE_SPLITS[pre]]
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [*isolate, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )

        table = _byte_decoder()
        special = {_UNKNOWN, _CONTROL, _USER_DEFINED}
        token_bytes = [t.encode() if ty in special else _bytelevel_bytes(t, table) for t, ty in zip(tokens, types)]
        of_type = lambda *want: {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in want}  # noqa: E731
        get = meta.get
        return cls(
            hf,
            token_bytes,
            control=of_type(_UNKNOWN, _CONTROL),  # llama.cpp parses unknown-type tokens like control ones
            user_defined=of_type(_USER_DEFINED),
            bos_id=get("tokenizer.ggml.bos_token_id"),
            eos_id=get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),  # llama.cpp's BPE default
            chat_template=get("tokenizer.chat_template"),
            extra_stop_ids=(get("tokenizer.ggml.eot_token_id"), get("tokenizer.ggml.eom_token_id")),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        try:
            hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:
            raise ModelError(f"cannot load {path / 'tokenizer.json'}: {e}") from e
        # Per-token bytes (for streaming) are only derivable for byte-level vocabs.
        if "ByteLevel" not in json.dumps(json.loads(hf.to_str()).get("decoder")):
            raise ModelError(f"{path / 'tokenizer.json'}: only byte-level BPE tokenizers are supported")
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        # Our own partition handles special added tokens, so HF must treat them as text;
        # non-special added tokens are still split by HF, as llama.cpp does for user-defined ones.
        hf.encode_special_tokens = True
        added = hf.get_added_tokens_decoder()  # id -> AddedToken

        table = _byte_decoder()
        token_bytes = [
            added[i].content.encode() if i in added else _bytelevel_bytes(hf.id_to_token(i) or "", table)
            for i in range(hf.get_vocab_size(with_added_tokens=True))
        ]

        def token_id(key: str) -> int | None:
            tok = cfg.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return hf.token_to_id(tok) if tok else None

        bos_id = token_id("bos_token")
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # no flag: see whether the post-processor prepends BOS
            add_bos = bos_id is not None and hf.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        return cls(
            hf,
            token_bytes,
            control={a.content: i for i, a in added.items() if a.special},
            user_defined={a.content: i for i, a in added.items() if not a.special},
            bos_id=bos_id,
            eos_id=token_id("eos_token"),
            add_bos=bool(add_bos),
            chat_template=cfg.get("chat_template") if isinstance(cfg.get("chat_template"), str) else None,
        )

    # ---- encode / decode ----------------------------------------------------------

    def encode(self, text: str, special: bool = True, add_bos: bool | None = None) -> list[int]:
        want_bos = self.add_bos if add_bos is None else add_bos
        ids = [self.bos_id] if want_bos and self.bos_id is not None else []
        for frag in self._partition(text, self._parse_special if special else self._parse_plain):
            if isinstance(frag, int):
                ids.append(frag)
            elif frag:  # ids past vocab_size are from_gguf's byte placeholders: llama.cpp drops those bytes
                ids.extend(i for i in self._hf.encode(frag, add_special_tokens=False).ids if i < self.vocab_size)
        return ids

    @staticmethod
    def _partition(text: str, specials: list[tuple[str, int]]) -> list[str | int]:
        """Cut special tokens out of the text, one token text at a time (llama.cpp's
        tokenizer_st_partition), leaving str fragments for BPE and ints for tokens."""
        frags: list[str | int] = [text]
        for tok, tid in specials:
            out: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or tok not in frag:
                    out.append(frag)
                    continue
                for j, piece in enumerate(frag.split(tok)):
                    out.extend([tid, piece] if j else [piece])
            frags = out
        return frags

    def token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes[token_id]

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        skip = self._control_ids if skip_special else frozenset()
        return b"".join(self._token_bytes[i] for i in ids if i not in skip).decode("utf-8", "replace")

    def streamer(self, skip_special: bool = False) -> TokenStreamer:
        return TokenStreamer(self, skip_special)

    # ---- chat ---------------------------------------------------------------------

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.decode([self.bos_id] if self.bos_id is not None else []),
                eos_token=self.decode([self.eos_id] if self.eos_id is not None else []),
            )
        except ModelError:
            raise
        except Exception as e:  # jinja errors, or a template tripping over a message's shape
            raise ModelError(f"chat template failed to render: {type(e).__name__}: {e}") from e

    @cached_property
    def _template(self):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # Same environment settings as HF transformers' apply_chat_template.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise_template_error
        try:
            return env.from_string(self.chat_template or CHATML_TEMPLATE)
        except Exception as e:
            raise ModelError(f"chat template does not parse: {e}") from e


def _raise_template_error(message: str):
    raise ModelError(f"chat template rejected the conversation: {message}")


class TokenStreamer:
    """Turns a stream of token ids into text, holding back incomplete UTF-8 sequences."""

    def __init__(self, tok: Tokenizer, skip_special: bool = False):
        self._tok = tok
        self._skip = tok._control_ids if skip_special else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """Text still buffered; a dangling partial character comes out as U+FFFD."""
        return self._utf8.decode(b"", final=True)
