"""Structured output: a Constraint (sampling.py) compiled by llguidance, the grammar engine
llama.cpp uses, against the model's own vocabulary, and one matcher per branch that masks the
tokens the grammar cannot take next (the Sampler's `Matcher`).

llguidance reads JSON Schema, Lark and GBNF (converted to Lark), and regular expressions; it
needs no torch. Special tokens (the tokenizer's control tokens) reach it prefixed with 0xff, its
convention for tokens that text can never produce, so a grammar cannot spell `<|im_end|>` as
text; the model's stop tokens are its end-of-sequence tokens, allowed once the grammar accepts.
"""

import json
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import llguidance as llg
import numpy as np

from localkv.errors import LocalkvError, first_line
from localkv.json_numbers import bounded_numbers
from localkv.model.tokenizer import Tokenizer
from localkv.sampling import Constraint

# readable JSON with no free whitespace: a small model given flexible whitespace can spend its
# whole reply on spaces and newlines; a schema's own "x-guidance" options override these
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

ANY_OBJECT = {"type": "object"}

_TOKENIZERS: "WeakKeyDictionary[Tokenizer, llg.LLTokenizer]" = WeakKeyDictionary()


def grammar_text(c: Constraint) -> str:
    """The constraint as an llguidance grammar (not yet checked against a vocabulary)."""
    where = f" in {c.source}" if c.source else ""
    try:
        if c.kind in ("json", "json_schema"):
            schema = ANY_OBJECT if c.kind == "json" else json.loads(c.text)
            if not isinstance(schema, dict):
                raise LocalkvError(f"invalid JSON schema{where}: expected a JSON object, got {type(schema).__name__}")
            # the first of these llguidance takes: it cannot intersect two open places (an allOf of
            # two open objects), and a rewrite must never fail a schema it takes as given, whose
            # own error is the one reported
            for s in (bounded_numbers(schema), bounded_numbers(schema, open_places=False), schema):
                # as text: llguidance refuses a dict holding an integer wider than 64 bits (a
                # bound of 10^20) and reads the same number in text as a double
                text = llg.LLMatcher.grammar_from_json_schema(json.dumps(s), defaults=JSON_OPTIONS)
                if not llg.LLMatcher.validate_grammar_with_warnings(text)[0]:
                    break
            return text
        return llg.grammar_from("regex" if c.kind == "regex" else "grammar", c.text)
    except json.JSONDecodeError as e:
        raise LocalkvError(
            f"invalid JSON schema{where}: not JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    except ValueError as e:
        raise LocalkvError(f"invalid {c.kind.replace('_', ' ')}{where}: {first_line(e)}") from None


def check(c: Constraint, tok: Tokenizer | None = None) -> str:
    """The compiled grammar text, or one LocalkvError line saying what is wrong with it. Without
    a tokenizer it runs before any model loads (a bad schema fails in a fraction of a second)."""
    text = grammar_text(c.validate())
    bad, messages = llg.LLMatcher.validate_grammar_with_warnings(text, ll_tokenizer(tok) if tok else None)
    if bad:
        where = f" in {c.source}" if c.source else ""
        raise LocalkvError(f"invalid {c.kind.replace('_', ' ')}{where}: {first_line(ValueError(messages[0]))}")
    return text


@dataclass(frozen=True, slots=True)
class Grammar:
    """A checked grammar for one vocabulary; matcher() starts a branch at its beginning (a lazy
    one's: free until its trigger)."""

    text: str
    tokenizer: llg.LLTokenizer
    vocab_size: int
    model_tokenizer: Tokenizer | None = None  # a lazy grammar reads the tokens' bytes
    trigger: bytes = b""

    @classmethod
    def compile(cls, c: Constraint, tok: Tokenizer) -> "Grammar":
        return cls(check(c, tok), ll_tokenizer(tok), tok.vocab_size, tok, c.trigger.encode("utf-8"))

    def matcher(self) -> "GrammarMatcher | LazyMatcher":
        if self.trigger:
            return LazyMatcher(self)
        return self.strict()

    def strict(self) -> "GrammarMatcher":
        return GrammarMatcher(llg.LLMatcher(self.tokenizer, self.text, log_level=0), self.vocab_size)


class GrammarMatcher:
    """One branch's position in the grammar: the Sampler asks allowed() before each draw and
    hands the drawn token to accept()."""

    def __init__(self, m: llg.LLMatcher, vocab_size: int):
        self._m, self._n = m, vocab_size
        self._bits = np.zeros((vocab_size + 31) // 32, np.int32)

    def allowed(self) -> np.ndarray:
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._raise_on_error()
        return np.unpackbits(self._bits.view(np.uint8), count=self._n, bitorder="little").view(bool)

    def copy(self) -> "GrammarMatcher":
        """An independent matcher at the same position (a draft model drafts on a copy)."""
        return GrammarMatcher(self._m.deep_copy(), self._n)

    def accept(self, token: int) -> None:
        if not self._m.consume_token(token):
            self._raise_on_error()
            raise RuntimeError(f"token {token} was drawn outside the grammar's mask (a bug in the sampler)")

    def feed(self, token: int) -> bool:
        """Take a token that was not drawn under this mask (a lazy grammar's start); whether
        the grammar could."""
        return bool(self._m.consume_token(token))

    def guide(self, draft: list[int], limit: int) -> list[int]:
        """A speculative draft from here: the tokens the grammar forces next (a schema's keys
        and punctuation; llguidance's fast-forward tokens), at most limit, or else the part of
        `draft` the grammar takes, cut at its first token the mask would refuse."""
        forced = self._m.compute_ff_tokens()
        if forced:
            return forced[:limit]
        return draft[: self._m.validate_tokens(draft)] if draft else draft

    @property
    def accepting(self) -> bool:
        """Whether the text so far is a complete match."""
        return self._m.is_accepting()

    def _raise_on_error(self):
        if self._m.is_error():
            raise LocalkvError(f"the grammar engine stopped: {first_line(RuntimeError(self._m.get_error()))}")


class LazyMatcher:
    """A lazy grammar's branch: every token may come until the reply's bytes hold the trigger;
    then the grammar (which starts with the trigger) is fed the reply from the trigger on and
    masks the rest. A trigger that ends inside a token whose remaining bytes the grammar cannot
    take leaves only the stop tokens: the reply ends, a text answer rather than a broken call."""

    def __init__(self, g: Grammar):
        self._g = g
        self._free = np.ones(g.vocab_size, bool)
        self._text = bytearray()
        self._starts: list[int] = []  # where each token's bytes begin in _text
        self._tokens: list[int] = []
        self._m: GrammarMatcher | None = None
        self._dead = False

    def allowed(self) -> np.ndarray:
        if self._dead:
            only_stops = np.zeros(self._g.vocab_size, bool)
            only_stops[[i for i in self._g.model_tokenizer.stop_ids if i < self._g.vocab_size]] = True
            return only_stops
        return self._free if self._m is None else self._m.allowed()

    def copy(self) -> "LazyMatcher":
        """An independent matcher at the same position (a draft model drafts on a copy)."""
        c = LazyMatcher.__new__(LazyMatcher)
        c._g, c._free, c._dead = self._g, self._free, self._dead  # _free is never written
        c._text, c._starts, c._tokens = bytearray(self._text), list(self._starts), list(self._tokens)
        c._m = self._m.copy() if self._m is not None else None
        return c

    def accept(self, token: int) -> None:
        if self._m is not None:
            return self._m.accept(token)
        if self._dead:
            return
        tok = self._g.model_tokenizer
        self._starts.append(len(self._text))
        self._tokens.append(token)
        self._text += tok.token_bytes(token)
        at = self._text.find(self._g.trigger, max(0, self._starts[-1] - len(self._g.trigger) + 1))
        if at >= 0:
            self._start(at)

    def _start(self, at: int) -> None:
        m = self._g.strict()
        if at in self._starts:  # the trigger begins a token: feed the model's own tokens
            ids = self._tokens[self._starts.index(at) :]
        else:  # the token before it carries text of its own: the trigger's bytes on, re-tokenized
            ids = self._g.tokenizer.tokenize_bytes(bytes(self._text[at:]))
        if all(m.feed(t) for t in ids):
            self._m = m
        else:
            self._dead = True

    def feed(self, token: int) -> bool:
        """Take a token that was not drawn under this mask; whether the reply can go on."""
        self.accept(token)
        return not self._dead

    def guide(self, draft: list[int], limit: int) -> list[int]:
        """GrammarMatcher.guide once triggered; before, any draft (the reply is free text)."""
        if self._dead:
            return []
        return self._m.guide(draft, limit) if self._m is not None else draft

    @property
    def triggered(self) -> bool:
        return self._m is not None

    @property
    def accepting(self) -> bool:
        return self._m is None or self._m.accepting


def ll_tokenizer(tok: Tokenizer) -> llg.LLTokenizer:
    """llguidance's view of a vocabulary: each token's bytes (specials marked), the stop tokens
    as its end-of-sequence tokens, and the model's own encoder. Built once per tokenizer."""
    got = _TOKENIZERS.get(tok)
    if got is None:
        eos = sorted(tok.stop_ids, key=lambda i: (i != tok.eos_id, i))
        got = _TOKENIZERS[tok] = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(tok)), eos_token=eos or None)
    return got


class _Vocab:
    """The fields and the encode call llguidance's TokenizerWrapper reads."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self._raw = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        # control tokens decode to nothing when specials are skipped: that is what marks them
        self.special_token_ids = [i for i, b in enumerate(self._raw) if b and tok.decode([i], skip_special=True) == ""]
        self.tokens = list(self._raw)
        for i in self.special_token_ids:
            self.tokens[i] = b"\xff" + self.tokens[i]
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.stop_ids, default=0)
        self.bos_token_id = tok.bos_id
        self._greedy: llg.LLTokenizer | None = None

    def __call__(self, text: bytes | str) -> list[int]:
        """The model's own tokens for text when they spell exactly its bytes; else (a
        SentencePiece encoder puts a space before the text) llguidance's greedy tokens, which
        do: llguidance cuts forced text at token boundaries and needs the bytes to match."""
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        ids = self._tok.encode(data.decode("utf-8", "replace"), special=False, add_bos=False)
        if b"".join(self._raw[i] for i in ids) == data:
            return ids
        if self._greedy is None:
            self._greedy = llg.LLTokenizer(llg.TokenizerWrapper(_GreedyOnly(self)))
        return self._greedy.greedy_tokenize(data.decode("utf-8", "replace"))


class _GreedyOnly:
    """The same vocabulary for an LLTokenizer used only for its greedy_tokenize (which never
    calls back into Python)."""

    def __init__(self, v: _Vocab):
        self.tokens, self.special_token_ids = v.tokens, v.special_token_ids
        self.eos_token_id, self.bos_token_id = v.eos_token_id, v.bos_token_id

    def __call__(self, text) -> list[int]:
        return []
