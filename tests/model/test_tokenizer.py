"""Tokenizer: llama.cpp parity (golden file + live llama-cpp-python), round trips,
streaming decode and chat templates. Unmarked tests use a tiny synthetic vocab."""

import json
from pathlib import Path

import pytest

from localkv.errors import ModelError
from localkv.model.pretokenize import byte_decoder, bytelevel_all, bytelevel_bytes
from localkv.model.tokenizer import CHATML_TEMPLATE, Tokenizer, _byte_decoder

GOLDEN = json.loads((Path(__file__).parents[1] / "data" / "tokenizer_golden.json").read_text())
CASES = GOLDEN["cases"]
CASE_IDS = [f"{i}:{c['text'][:20]!r}" for i, c in enumerate(CASES)]
WIDE_TEXT = "naïve 日本語のテキスト 🙂🚀 👍🏽 Привет مرحبا 👨\u200d👩\u200d👧"

# ---- a tiny synthetic byte-level vocab (no model needed) -------------------------

BYTE_CHARS = sorted(_byte_decoder(), key=_byte_decoder().get)  # index == byte value
BYTE_CHARS[4] = "<unused>"  # like SmolLM2, the vocab lacks a token for byte 0x04
SPECIALS = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool>", 4)]


def tiny_meta(**overrides) -> dict:
    tokens = [*BYTE_CHARS, "he", "hel", "hell", "hello", ".."] + [t for t, _ in SPECIALS]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 261 + [ty for _, ty in SPECIALS],
        "tokenizer.ggml.merges": ["h e", "he l", "hel l", "hell o", ". ."],
        "tokenizer.ggml.bos_token_id": 262,  # <|im_start|>
        "tokenizer.ggml.eos_token_id": 263,  # <|im_end|>
        "tokenizer.ggml.add_bos_token": False,
    }
    return {**meta, **overrides}


@pytest.fixture
def tiny():
    return Tokenizer.from_gguf_metadata(tiny_meta())


def byte_ids(text: str) -> list[int]:
    return list(text.encode())


def test_tiny_bpe_merges_and_digits_split(tiny):
    assert tiny.encode("hello", special=False) == [259]
    # smollm isolates every digit before the GPT-2 regex: " 12" is " ", "1", "2", not " 12"
    assert tiny.encode("hello 12") == [259, 32, 49, 50]


def test_control_tokens_parsed_only_with_special(tiny):
    text = "hello<|im_end|>x"
    assert tiny.encode(text, special=True) == [259, 263, ord("x")]
    assert tiny.encode(text, special=False) == [259, *byte_ids("<|im_end|>x")]


def test_user_defined_tokens_always_parsed(tiny):
    # llama.cpp (and HF) split user-defined tokens out even when special=False
    assert tiny.encode("a<tool>b", special=False) == [ord("a"), 264, ord("b")]


def test_add_bos_flag_and_override(tiny):
    assert tiny.encode("hello") == [259]
    assert tiny.encode("hello", add_bos=True) == [262, 259]
    with_bos = Tokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.ggml.add_bos_token": True}))
    assert with_bos.encode("hello") == [262, 259]
    assert with_bos.encode("hello", add_bos=False) == [259]


def test_decode_renders_specials_verbatim_unless_skipped(tiny):
    ids = [262, 259, 263, 264]
    assert tiny.decode(ids) == "<|im_start|>hello<|im_end|><tool>"
    assert tiny.decode(ids, skip_special=True) == "hello<tool>"  # user-defined tokens are text


def test_stop_ids_include_eos_and_turn_ends(tiny):
    assert tiny.stop_ids == {261, 263}  # <|endoftext|>, <|im_end|>
    assert tiny.eos_id == 263 and tiny.vocab_size == 265


def test_byte_missing_from_vocab_is_dropped_but_blocks_merges(tiny):
    assert tiny.encode("....") == [260, 260]
    # llama.cpp: no token for 0x04, so it vanishes, yet the dots around it never merge
    assert tiny.encode(".\x04.") == [46, 46]


def test_streamer_holds_back_partial_utf8(tiny):
    st = tiny.streamer()
    out = [st.push(b) for b in "é🙂".encode()]  # one byte token per push
    assert out == ["", "é", "", "", "", "🙂"]
    assert st.flush() == ""


def test_streamer_flush_emits_dangling_bytes(tiny):
    st = tiny.streamer()
    assert st.push("🙂".encode()[0]) == ""
    assert st.flush() == "\ufffd"


def test_streamer_skip_special(tiny):
    st = tiny.streamer(skip_special=True)
    assert [st.push(i) for i in (262, 259, 263)] == ["", "hello", ""]


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("tokenizer.ggml.model", "bert", "unsupported tokenizer model"),
        ("tokenizer.ggml.pre", "kimi-k2", "unsupported pre-tokenizer"),
    ],
)
def test_unsupported_tokenizers_are_refused(key, value, match):
    with pytest.raises(ModelError, match=match):
        Tokenizer.from_gguf_metadata(tiny_meta(**{key: value}))


CONVO = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
CHATML = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"


def test_chatml_fallback_without_template(tiny):
    assert tiny.chat_template is None
    assert tiny.render_chat(CONVO) == CHATML + "<|im_start|>assistant\n"
    assert tiny.render_chat(CONVO, add_generation_prompt=False) == CHATML


def test_template_variables_and_trim_blocks():
    tpl = "{{ bos_token }}\n{% for m in messages %}\n  {{ m['content'] }}|\n{% endfor %}{{ eos_token }}"
    tok = Tokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.chat_template": tpl}))
    # trim_blocks eats the newline after a block tag, lstrip_blocks the indent before one
    assert tok.render_chat(CONVO) == "<|im_start|>\n  You are terse.|\n  Hi!|\n<|im_end|>"


@pytest.mark.parametrize(
    "tpl, match",
    [
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{% for m in messages %}", "does not parse"),
        ("{{ messages[5]['content'] + 1 }}", "failed to render"),
        ("{{ ''.__class__.__mro__ }}", "failed to render"),  # sandboxed
    ],
)
def test_template_errors_become_model_errors(tpl, match):
    tok = Tokenizer.from_gguf_metadata(tiny_meta(**{"tokenizer.chat_template": tpl}))
    with pytest.raises(ModelError, match=match):
        tok.render_chat(CONVO)


def save_hf_dir(tok: Tokenizer, d: Path, **config) -> Path:
    """Re-save a GGUF-built tokenizer as a Hugging Face tokenizer directory."""
    from tokenizers import AddedToken, decoders
    from tokenizers import Tokenizer as HFTokenizer

    spec = json.loads(tok._hf.to_str())  # drop the byte placeholders from_gguf added
    spec["model"]["vocab"] = {t: i for t, i in spec["model"]["vocab"].items() if i < tok.vocab_size}
    hf = HFTokenizer.from_str(json.dumps(spec))
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tok._control])
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in tok._user_defined])
    hf.decoder = decoders.ByteLevel()
    hf.save(str(d / "tokenizer.json"))
    cfg = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "chat_template": tok.chat_template}
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **config}))
    return d


def test_hf_dir_special_handling(tiny, tmp_path):
    hft = Tokenizer.from_hf_dir(save_hf_dir(tiny, tmp_path))
    assert (hft.bos_id, hft.eos_id, hft.add_bos, hft.stop_ids) == (262, 263, False, {261, 263})
    assert hft.encode("hello<|im_end|>x") == [259, 263, ord("x")]
    assert hft.encode("hello<|im_end|>x", special=False) == [259, *byte_ids("<|im_end|>x")]
    assert hft.encode("a<tool>b", special=False) == [ord("a"), 264, ord("b")]
    assert hft.decode([262, 259, 264], skip_special=True) == "hello<tool>"


def test_hf_dir_add_bos_flag(tiny, tmp_path):
    hft = Tokenizer.from_hf_dir(save_hf_dir(tiny, tmp_path, add_bos_token=True))
    assert hft.encode("hello") == [262, 259]


def test_hf_dir_without_bytelevel_decoder_is_refused(tiny, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders

    hf = HFTokenizer.from_file(str(save_hf_dir(tiny, tmp_path) / "tokenizer.json"))
    hf.decoder = decoders.Metaspace()
    hf.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ModelError, match="byte-level"):
        Tokenizer.from_hf_dir(tmp_path)


# ---- the real SmolLM2 model --------------------------------------------------------


@pytest.fixture(scope="session")
def tok(real_model_path):
    return Tokenizer.from_gguf(real_model_path)


@pytest.mark.model
def test_model_metadata(tok):
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == (49152, 1, 2, False)
    # <|im_end|> is eos, <|endoftext|> also ends a turn, and llama.cpp stops on <reponame> (a FIM repo token)
    assert tok.stop_ids == {0, 2, 4}
    assert "<|im_start|>" in tok.chat_template


@pytest.mark.model
def test_golden_corpus_covers_the_brief():
    texts = "".join(c["text"] for c in CASES)
    assert len(CASES) >= 30
    for needle in ["    return", "\t", "1,000,000", "\n\n\n", "I'll", "日本", "🙂", "Привет", "مرحبا", "<|im_start|>"]:
        assert needle in texts, needle


@pytest.mark.model
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_matches_llama_cpp_golden(tok, case):
    assert tok.encode(case["text"], special=True) == case["special"]
    assert tok.encode(case["text"], special=False) == case["plain"]


@pytest.mark.model
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_round_trip(tok, case):
    text = case["text"]
    if any(c in text for c in "\x04\x1d\U0007ddad"):  # bytes the vocab cannot represent
        assert tok.decode(tok.encode(text)) != text
        return
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, special=False)) == text


@pytest.mark.model
def test_special_flag_changes_chat_text_encoding(tok):
    text = "<|im_start|>user\nhi<|im_end|>\n"
    assert tok.encode(text)[0] == 1 and 2 in tok.encode(text)
    assert not {1, 2} & set(tok.encode(text, special=False))
    assert tok.decode(tok.encode(text), skip_special=True) == "user\nhi\n"


@pytest.mark.model
def test_streamer_never_emits_half_a_character(tok):
    ids = tok.encode(WIDE_TEXT)
    st = tok.streamer()
    chunks = [st.push(i) for i in ids]
    assert "" in chunks  # some token ended mid-character, so the buffering was exercised
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) + st.flush() == WIDE_TEXT


@pytest.mark.model
def test_model_chat_template(tok):
    assert tok.render_chat(CONVO) == CHATML + "<|im_start|>assistant\n"
    # SmolLM2's own template adds its default system prompt; the ChatML fallback would not
    default = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    assert tok.render_chat(CONVO[1:], add_generation_prompt=False) == default + CHATML.split("<|im_end|>\n", 1)[1]
    assert tok.chat_template != CHATML_TEMPLATE


@pytest.fixture(scope="session")
def hf_dir(tok, tmp_path_factory):
    return save_hf_dir(tok, tmp_path_factory.mktemp("hf"))


@pytest.mark.model
def test_from_hf_dir_matches_golden(hf_dir):
    hft = Tokenizer.from_hf_dir(hf_dir)
    assert (hft.vocab_size, hft.bos_id, hft.eos_id, hft.add_bos) == (49152, 1, 2, False)
    assert hft.stop_ids == {0, 2, 4}
    for case in CASES[:-1]:  # the last case needs the byte placeholders only from_gguf adds
        assert hft.encode(case["text"]) == case["special"], case["text"]
        assert hft.encode(case["text"], special=False) == case["plain"], case["text"]
        assert hft.decode(case["special"]) == case["text"]
    assert hft.render_chat(CONVO) == CHATML + "<|im_start|>assistant\n"


# ---- live comparison with llama.cpp --------------------------------------------------

EXTRA = [
    "\x06\x13\x14\x16!!\x04\n",
    "\U000f0000\U00100000\uffff\x7f\x00",
    "  x",
    "x  \n  y",
    "   \n\n  \t ",
    "a1b22c333",
    "naïve\u00a0café",
    WIDE_TEXT,
    "'''\"\"\"``",
    "<|im_end|><|im_end|>",
]


@pytest.fixture(scope="session")
def llama(real_model_path):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(real_model_path), vocab_only=True, verbose=False)


@pytest.mark.model
@pytest.mark.peer
@pytest.mark.parametrize("special", [True, False])
def test_matches_llama_cpp_live(tok, llama, special):
    texts = [c["text"] for c in CASES] + EXTRA
    ours = [tok.encode(t, special=special) for t in texts]
    ref = [llama.tokenize(t.encode(), add_bos=False, special=special) for t in texts]
    assert [t for t, a, b in zip(texts, ours, ref) if a != b] == []
    # and the golden file is still what this llama.cpp says
    key = "special" if special else "plain"
    assert [c[key] for c in CASES] == ref[: len(CASES)]


@pytest.mark.model
@pytest.mark.peer
def test_decode_matches_llama_cpp_detokenize(tok, llama):
    for text in [c["text"] for c in CASES] + EXTRA:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special=True) == llama.detokenize(ids).decode(errors="replace"), text
        assert tok.decode(ids) == llama.detokenize(ids, special=True).decode(errors="replace"), text


def test_piece_bytes_of_a_whole_vocabulary_match_piece_by_piece():
    """bytelevel_all (one lookup for the vocabulary, at every start) renders each piece as
    bytelevel_bytes does; a piece with a char no byte maps to sends it piece by piece."""
    table = byte_decoder()
    pieces = [*BYTE_CHARS, "ĠhelloĊ", "", "a b", "Ã©", "<|im_end|>", "..."]
    assert bytelevel_all(pieces) == [bytelevel_bytes(p, table) for p in pieces]
    assert bytelevel_all(["ok", "日本"]) is None and bytelevel_all(["ok", "\u00ad"]) is None
    assert bytelevel_all([]) == []
    tok = Tokenizer.from_gguf_metadata(tiny_meta())  # the tiny vocab's pieces, specials verbatim
    assert tok.token_bytes(262) == b"<|im_start|>" and tok.token_bytes(256) == b"he"
