"""Tokenizers of the model families people run, id for id against llama.cpp.

The vocabularies are the real ones (scripts/fetch_vocab.py puts them in a cache; conftest's
`vocabularies`): each family's tiny recipe from scripts/make_model.py is written as a
vocab-only GGUF, and llama-cpp-python opens the same file. llama.cpp's own vocab GGUFs
(shipped in llama-cpp-python's source package) cover more pre-tokenizers.
"""

from pathlib import Path

import pytest

from localkv.errors import ModelError
from localkv.model.tokenizer import Tokenizer
from localkv.model.tokenizer_gguf import read_metadata
from resources import script

ROOT = Path(__file__).resolve().parents[2]
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install -e '.[peer]')")
# every test here needs llama-cpp-python (the module skips without it) and the real vocabularies
pytestmark = [pytest.mark.peer, pytest.mark.usefixtures("vocabularies")]


make_model = script("make_model")


# family -> (its tiny recipe, the token that ends its assistant turn, its generation prompt)
FAMILIES = {
    "llama3": ("tiny-llama3", "<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "llama2": ("tiny-llama2", "</s>", "<|im_start|>assistant\n"),  # no template: ChatML fallback
    "mistral": ("tiny-mistral", "</s>", "[/INST]"),
    "qwen2.5": ("tiny-qwen2", "<|im_end|>", "<|im_start|>assistant\n"),
    "qwen3": ("tiny-qwen3", "<|im_end|>", "<|im_start|>assistant\n"),
    "gemma2": ("tiny-gemma2", "<end_of_turn>", "<start_of_turn>model\n"),
    "gemma3": ("tiny-gemma3", "<end_of_turn>", "<start_of_turn>model\n"),
    "phi3": ("tiny-phi3", "<|end|>", "<|assistant|>\n"),
}
SPECIALS = (
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|im_start|>user\nhi<|im_end|>\n"
    "<s>[INST] hi [/INST]</s> <start_of_turn>user\nhey<end_of_turn>\n<|user|>\n  Hi<|end|>\n<|assistant|>\n"
    "<|endoftext|><unk><bos><eos><pad> <think>x</think> <|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>"
)
TEXTS = [
    "",
    " ",
    "Hello world",
    "  Hello  World!\n\n\tdef f(x):\n        return x**2  # squared\n",
    'for (int i = 0; i < n; i++) {\n\tif (x[i] != 0) count += 1;\n}\n{"k": [1, 2.5e-3, null]}',
    "1 12 123 1234 12345 3.14159 1,000,000 2024-06-01 0x1F ٣٤٥ ½ ３",
    "日本語のテキストです。中文测试，句子。한국어 문장입니다.",
    "🙂🚀 👍🏽 👨\u200d👩\u200d👧 🏳️\u200d🌈",
    "naïve café Привет мир مرحبا שלום ελληνικά",
    "e\u0301 a\u0308 \u00a0nbsp\u2003em \u200bzw",
    "   leading and trailing   ",
    "\n\n\n\n",
    "  \n  \n\t\t\n",
    "I'll we've they're it's DON'T Y'ALL",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "\x00\x01\x7f control bytes",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U000f0000 \uffff",
    " ▁ ▁▁x <0x41> [PAD32011]",
    SPECIALS,
]
CONVO = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye?"},
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, vocabularies):
    """(name, vocab-only GGUF path, our tokenizer, llama.cpp on the same file)."""
    name = request.param
    recipe = make_model.RECIPES[FAMILIES[name][0]]
    path = tmp_path_factory.mktemp(name) / "vocab.gguf"
    try:
        make_model.write_gguf(recipe, path, vocab_only=True)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    ref = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return name, path, Tokenizer.from_gguf(path), ref


def _piece(ref, token: int, special: bool) -> bytes:
    buf = llama_cpp.ctypes.create_string_buffer(256)  # llama-cpp-python's own helper cuts pieces at 32 bytes
    vocab = llama_cpp.llama_model_get_vocab(ref.model)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    return buf.raw[:n]


@pytest.mark.parametrize("special", [True, False])
def test_encode_matches_llama_cpp(family, special):
    name, _, tok, ref = family
    for text in TEXTS:
        for add_bos in (True, False):
            want = ref.tokenize(text.encode(), add_bos=add_bos, special=special)
            assert tok.encode(text, special=special, add_bos=None if add_bos else False) == want, (name, text)


def test_long_text_matches_llama_cpp(family):
    name, _, tok, ref = family
    text = (ROOT / "README.md").read_text()[:8000] + (ROOT / "localkv" / "model" / "tokenizer.py").read_text()[:6000]
    assert tok.encode(text, special=False) == ref.tokenize(text.encode(), add_bos=True, special=False), name


def test_stop_ids_are_llama_cpps_end_of_generation_set(family):
    name, _, tok, ref = family
    vocab = llama_cpp.llama_model_get_vocab(ref.model)
    eog = {i for i in range(ref.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert tok.stop_ids == eog
    turn_end = FAMILIES[name][1]
    assert tok.encode(turn_end, add_bos=False) == [tid := tok.encode(turn_end, add_bos=False)[0]]
    assert tid in tok.stop_ids


def test_token_pieces_match_llama_cpp(family):
    """Every special id and a spread of ordinary ones render as llama.cpp renders them."""
    _, _, tok, ref = family
    ids = set(range(0, tok.vocab_size, 97)) | set(tok._control_ids) | set(tok._user_defined.values())
    ids |= set(tok.encode("".join(TEXTS)))
    for i in sorted(ids):
        assert tok.token_bytes(i) == _piece(ref, i, special=True), i
        hidden = _piece(ref, i, special=False) == b"" and _piece(ref, i, special=True) != b""
        assert (i in tok._control_ids) == hidden, i


@pytest.mark.parametrize("special", [True, False])
def test_round_trip(family, special):
    name, _, tok, _ = family
    # not the specials lines: SentencePiece adds a space after a special token, Phi-3's eat one
    for text in TEXTS[:-2]:
        assert tok.decode(tok.encode(text, special=special), skip_special=True) == text, (name, text)
        ids = tok.encode(text, special=special, add_bos=False)  # no BOS: the prefix space stays
        assert tok.decode(ids).removeprefix(" " if tok.add_bos and tok._space_prefix else "") == text


def test_chat_template(family):
    name, _, tok, ref = family
    _, turn_end, gen_prompt = FAMILIES[name]
    convo = CONVO[1:] if name == "gemma2" else CONVO
    text = tok.render_chat(convo, add_generation_prompt=True)
    assert text.endswith(gen_prompt)
    assert all(m["content"] in text for m in convo)
    if name != "mistral":  # [/INST] closes every user turn: Mistral has no separate generation prompt
        assert not tok.render_chat(convo, add_generation_prompt=False).endswith(gen_prompt)
    # what llama.cpp's chat path does with the rendered prompt: add_special and parse_special
    ids = tok.encode(text)
    assert ids == ref.tokenize(text.encode(), add_bos=True, special=True)
    assert ids.count(tok.bos_id) == (1 if tok.add_bos else 0) or tok.bos_id in tok.stop_ids
    if name not in ("llama2",):  # the ChatML fallback has no <|im_end|> in Llama 2's vocabulary
        assert tok.encode(turn_end, add_bos=False)[0] in ids


def test_family_system_prompt_rules(family):
    name, _, tok, _ = family
    if name == "gemma2":  # Gemma 2's template refuses a system turn
        with pytest.raises(ModelError, match="System role not supported"):
            tok.render_chat(CONVO)
    if name == "gemma3":  # Gemma 3 folds the system prompt into the first user turn
        assert "<start_of_turn>user\nYou are terse.\n\nHi!" in tok.render_chat(CONVO)
    if name == "qwen2.5":  # Qwen2.5 supplies its own system prompt when none is given
        assert tok.render_chat(CONVO[1:]).startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    if name == "qwen3":
        assert tok.render_chat(CONVO[1:]).startswith("<|im_start|>user\nHi!")
    if name == "llama3":
        assert tok.render_chat(CONVO).startswith("<|start_header_id|>system<|end_header_id|>\n\nYou are terse.")


# ---- llama.cpp's own vocab files: more pre-tokenizers, real conversions ---------------

# llama.cpp's own converted vocabularies (shipped in llama-cpp-python's source package)
LLAMA_CPP_VOCABS = [
    "aquila",
    "baichuan",
    "bert-bge",
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",
    "gpt-2",
    "gpt-neox",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "nomic-bert-moe",
    "phi-3",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
]


@pytest.mark.parametrize("name", LLAMA_CPP_VOCABS)
def test_llama_cpp_vocab_files(name, vocabularies):
    path = vocabularies / "llama.cpp" / f"ggml-vocab-{name}.gguf"
    meta = read_metadata(path)
    if meta["tokenizer.ggml.model"] not in ("gpt2", "llama"):
        with pytest.raises(ModelError, match="unsupported tokenizer model"):
            Tokenizer.from_gguf_metadata(meta)
        return
    tok = Tokenizer.from_gguf_metadata(meta)
    ref = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    inp = path.with_name(path.name + ".inp")
    texts = TEXTS + (inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n") if inp.exists() else [])
    for text in texts:
        for special in (True, False):
            assert tok.encode(text, special=special) == ref.tokenize(text.encode(), add_bos=True, special=special)


def test_pre_tokenizer_regex_is_what_makes_llama3_match(tmp_path, monkeypatch, vocabularies):
    """Llama 3 splits digits in threes, Qwen2 one by one: the regex list is load-bearing."""
    from localkv.model import pretokenize

    path = tmp_path / "vocab.gguf"
    try:
        make_model.write_gguf(make_model.RECIPES["tiny-llama3"], path, vocab_only=True)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    meta = read_metadata(path)
    ref = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    text = "12345678 apples"
    assert Tokenizer.from_gguf_metadata(meta).encode(text) == ref.tokenize(text.encode(), add_bos=True, special=True)
    monkeypatch.setitem(pretokenize.PRE_REGEXES, "llama-bpe", pretokenize.PRE_REGEXES["qwen2"])
    assert Tokenizer.from_gguf_metadata(meta).encode(text) != ref.tokenize(text.encode(), add_bos=True, special=True)


def test_unknown_pre_tokenizer_is_refused():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "kimi-k2", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ModelError, match="unsupported pre-tokenizer 'kimi-k2'"):
        Tokenizer.from_gguf_metadata(meta)
