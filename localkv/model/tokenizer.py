"""Text <-> token ids, matching llama.cpp's tokenizer (`llama_tokenize`) id for id.

Encoding runs in two stages, as llama.cpp's does:
  1. special-token partition: control tokens (only when `special=True`) and
     user-defined tokens (always) are cut out of the text as whole tokens;
  2. every remaining text fragment goes through the vocabulary's own algorithm:
     byte-level BPE behind llama.cpp's pre-tokenizer regexes (pretokenize.py), or
     SentencePiece-style merge-by-score with byte fallback (tokenizer_spm.py),
     which also puts a space before each fragment that follows a special token.

Decoding maps each id to its raw bytes (byte-level pieces unmapped, SentencePiece
spaces restored, specials verbatim), so a streamer can hold back half a UTF-8 character.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from localkv import dry
from localkv.errors import ModelError
from localkv.model import chat_template
from localkv.model.pretokenize import bpe_model, pre_name
from localkv.model.pretokenize import byte_decoder as _byte_decoder
from localkv.model.tokenizer_gguf import read_metadata
from localkv.model.tokenizer_spm import SpmEncoder
from localkv.model.tokenizer_vocab import CONTROL, NORMAL, USER_DEFINED, vocab_from_gguf

__all__ = ["CHATML_TEMPLATE", "TokenStreamer", "Tokenizer", "_byte_decoder"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_C_SPACE = " \t\n\v\f\r"  # what C's isspace() strips after a right-stripping special token


class Tokenizer:
    """A model's tokenizer: encode/decode, streaming decode and chat-template rendering."""

    def __init__(
        self,
        encode_text: Callable[[str], list[int]],
        token_bytes: list[bytes],
        control: dict[str, int],
        user_defined: dict[str, int],
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        chat_template: str | None,
        stop_ids: set[int],
        *,
        add_eos: bool = False,
        space_prefix: bool = False,
        rstrip: frozenset[int] = frozenset(),
        hf: HFTokenizer | None = None,
    ):
        self._encode_text = encode_text  # one text fragment (no special tokens in it) -> ids
        self._token_bytes = token_bytes
        self._control = control  # text -> id, parsed only when special=True
        self._user_defined = user_defined  # text -> id, always parsed (llama.cpp and HF agree)
        self._control_ids = frozenset(control.values())
        self._hf = hf
        self._space_prefix = space_prefix  # SentencePiece: a space before text that follows a special token
        # Partition order: longest token text first, as llama.cpp sorts its special-token cache.
        by_length = lambda d: sorted(((t, i, i in rstrip) for t, i in d.items()), key=lambda s: -len(s[0]))  # noqa: E731
        self._parse_special = by_length({**control, **user_defined})
        self._parse_plain = by_length(user_defined)
        self.vocab_size = len(token_bytes)
        self.bos_id, self.eos_id, self.add_bos, self.add_eos = bos_id, eos_id, add_bos, add_eos
        self.chat_template = chat_template
        self.stop_ids: set[int] = set(stop_ids)
        self._breaker_masks: dict[tuple[str, ...], np.ndarray] = {}

    # ---- construction -------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        return cls.from_gguf_metadata(read_metadata(path))

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ModelError(
                f"unsupported tokenizer model {kind!r} (supported: byte-level BPE 'gpt2', SentencePiece 'llama')"
            )
        spm = kind == "llama"
        pre = "default" if spm else pre_name(meta.get("tokenizer.ggml.pre"))
        if "tokenizer.ggml.tokens" not in meta:
            raise ModelError("the GGUF has no tokenizer.ggml.tokens: it carries no vocabulary")
        vocab = vocab_from_gguf(meta, spm, pre)
        n = len(vocab.tokens)
        hf = None
        if spm:
            scores = meta.get("tokenizer.ggml.scores") or [0.0] * n
            encode_text = SpmEncoder(vocab.tokens, scores, vocab.unk_id).encode
        else:
            hf = bpe_model(vocab.ids, n, list(meta.get("tokenizer.ggml.merges") or []), pre)

            def encode_text(text: str) -> list[int]:
                # ids past the vocab are bpe_model's byte placeholders: llama.cpp drops those bytes
                return [i for i in hf.encode(text, add_special_tokens=False).ids if i < n]

        control, user_defined = vocab.of_kinds(CONTROL, USER_DEFINED)
        return cls(
            encode_text,
            vocab.piece_bytes(),
            control=control,
            user_defined=user_defined,
            bos_id=vocab.bos_id,
            eos_id=vocab.eos_id,
            add_bos=vocab.add_bos,
            chat_template=meta.get("tokenizer.chat_template"),
            stop_ids=vocab.stop_ids,
            add_eos=vocab.add_eos,
            space_prefix=spm and vocab.add_space_prefix,
            rstrip=vocab.rstrip,
            hf=hf,
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

        tokens = [hf.id_to_token(i) or f"[PAD{i}]" for i in range(hf.get_vocab_size(with_added_tokens=True))]
        types = [(CONTROL if added[i].special else USER_DEFINED) if i in added else NORMAL for i in range(len(tokens))]

        def token_id(key: str) -> int | None:
            tok = cfg.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return hf.token_to_id(tok) if tok else None

        bos_id = token_id("bos_token")
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # no flag: see whether the post-processor prepends BOS
            add_bos = bos_id is not None and hf.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        # the GGUF metadata convert_hf_to_gguf would write, so both formats get llama.cpp's token roles
        meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
        meta |= {"tokenizer.ggml.add_bos_token": bool(add_bos), "tokenizer.ggml.add_eos_token": False}
        meta |= {f"tokenizer.ggml.{k}_token_id": token_id(f"{k}_token") for k in ("bos", "eos")}
        vocab = vocab_from_gguf({k: v for k, v in meta.items() if v is not None}, False, "", default_ids=False)
        control, user_defined = vocab.of_kinds(CONTROL, USER_DEFINED)
        return cls(
            lambda text: hf.encode(text, add_special_tokens=False).ids,
            vocab.piece_bytes(),
            control=control,
            user_defined=user_defined,
            bos_id=vocab.bos_id,
            eos_id=vocab.eos_id,
            add_bos=vocab.add_bos,
            chat_template=cfg.get("chat_template") if isinstance(cfg.get("chat_template"), str) else None,
            stop_ids=vocab.stop_ids,
            hf=hf,
        )

    # ---- encode / decode ----------------------------------------------------------

    def encode(self, text: str, special: bool = True, add_bos: bool | None = None) -> list[int]:
        """llama_tokenize(text, add_special, parse_special=special); add_bos None means the model's default."""
        want_bos = self.add_bos if add_bos is None else add_bos
        ids = [self.bos_id] if want_bos and self.bos_id is not None else []
        after_special = True  # llama.cpp's SPM: a fragment at the start or after a special gets a leading space
        for frag in self._partition(text, self._parse_special if special else self._parse_plain):
            if isinstance(frag, int):
                ids.append(frag)
                after_special = True
            elif frag:
                ids.extend(self._encode_text(" " + frag if self._space_prefix and after_special else frag))
                after_special = False
        if add_bos is None and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    @staticmethod
    def _partition(text: str, specials: list[tuple[str, int, bool]]) -> list[str | int]:
        """Cut special tokens out of the text, one token text at a time (llama.cpp's
        tokenizer_st_partition), leaving str fragments for the model and ints for tokens."""
        frags: list[str | int] = [text]
        for tok, tid, rstrip in specials:
            out: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or tok not in frag:
                    out.append(frag)
                    continue
                for j, piece in enumerate(frag.split(tok)):
                    out.extend([tid, piece.lstrip(_C_SPACE) if rstrip else piece] if j else [piece])
            frags = out
        return frags

    def token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes[token_id]

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """The text of `ids`; a SentencePiece prompt that starts with BOS loses the space that
        encode() put before its first word (as llama-cpp-python's detokenize does)."""
        skip = self._control_ids if skip_special else frozenset()
        bos_first = self._space_prefix and bool(ids) and ids[0] == self.bos_id
        head = b"" if not bos_first or ids[0] in skip else self._token_bytes[ids[0]]
        out = b"".join(self._token_bytes[i] for i in ids[1 if bos_first else 0 :] if i not in skip)
        if bos_first and out.startswith(b" "):
            out = out[1:]
        return (head + out).decode("utf-8", "replace")

    def streamer(self, skip_special: bool = False) -> TokenStreamer:
        return TokenStreamer(self, skip_special)

    def breaker_mask(self, breakers: tuple[str, ...]) -> np.ndarray:
        """DRY's sequence breakers as a bool per token id, computed once per breaker set: a scan
        of the whole vocabulary is too slow for every request."""
        mask = self._breaker_masks.get(breakers)
        if mask is None:
            mask = self._breaker_masks[breakers] = dry.breaker_mask(self._token_bytes, breakers)
        return mask

    # ---- chat ---------------------------------------------------------------------

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        variables: dict | None = None,
    ) -> str:
        """The conversation as the model's template writes it (`tools`: the template's variable of
        that name, OpenAI's function tools; `variables`: more of them, e.g. `enable_thinking`).
        When encode() adds BOS (or EOS) itself, a BOS the template writes first (EOS last) is
        dropped, as llama.cpp's chat code does, so encode(render_chat(...)) holds exactly one."""
        bos = self.decode([self.bos_id] if self.bos_id is not None else [])
        eos = self.decode([self.eos_id] if self.eos_id is not None else [])
        text = chat_template.render(
            self._template,
            **(variables or {}),
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
            tools=tools,
        )
        if self.add_bos and bos and text.startswith(bos):
            text = text[len(bos) :]
        if self.add_eos and eos and text.endswith(eos):
            text = text[: -len(eos)]
        return text

    @cached_property
    def _template(self):
        return chat_template.compile_template(self.chat_template or CHATML_TEMPLATE)


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
