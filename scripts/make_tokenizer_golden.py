"""Write tests/data/tokenizer_golden.json: llama.cpp's token ids for a text corpus.

The reference is llama-cpp-python (pip install -e '.[peer]'), so the tokenizer
parity test keeps working on machines without it.

    python scripts/make_tokenizer_golden.py [MODEL.gguf]
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "tokenizer_golden.json"
sys.path.insert(0, str(ROOT))  # run from a checkout without installing localkv

PROSE = (
    "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times; "
    'Mr. Darcy\'s estate (Pemberley) was "magnificent" -- or so they said!'
)
PYTHON = 'def add(a, b):\n    """Add two numbers."""\n    if a > b:\n        return a + b\n    return b - a  # done\n'
TABS = "for (int i = 0; i < n; i++) {\n\tif (x[i] != 0)\n\t\tcount += 1;\n}\n"

CORPUS = [
    "",
    " ",
    "Hello world",
    "hello World!",
    PROSE,
    PYTHON,
    TABS,
    '{"name": "localkv", "version": [0, 1, 0], "ok": true}',
    "x^2 + y_1 = 3e-5; f'(x) -> 0 && a||b <= c != d",
    "https://example.com/path?q=1&r=two#frag",
    "12345 3.14159 1,000,000",
    "0 00 007 2024-06-01 12:30:45 $19.99 -42 +7 1e10 0x1F",
    "½ ² ³ ３ ١٢٣ Ⅻ",
    "a  b   c    d",
    "line one\nline two\n\nline four\n\n\n",
    "\n\n\n",
    "trailing spaces   ",
    "   leading spaces",
    "\ttab\t\ttabs\t",
    "windows\r\nline\r\nendings",
    "non\u00a0breaking\u2003em\u3000ideographic",
    "I'll don't WE'RE you've she'd it's",
    "'s 't 're 've 'm 'll 'd 'S 'LL",
    "It\u2019s a \u201cquoted\u201d \u2014 dash",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe",
    "e\u0301 combining acute",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002\u4e2d\u6587\u5b57\u7b26",
    "\ud55c\uad6d\uc5b4 \u0939\u093f\u0928\u094d\u0926\u0940 \u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u041a\u0430\u043a \u0434\u0435\u043b\u0430?",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "emoji \U0001f642\U0001f680 \U0001f44d\U0001f3fd family \U0001f468\u200d\U0001f469\u200d\U0001f467 flag \U0001f1eb\U0001f1f7",
    "!!!!!!!!!!!! ........ ----------",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|> <jupyter_code>x",
    "<|im_start <|im_sta|> < |im_end|> <|IM_END|>",
    # bytes with no token in SmolLM2's vocab: llama.cpp drops them but never merges across them
    "..\x04.. \u24c3\U0007ddad x\x1dy",
]


def reference(model_path: str) -> list[dict]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
    tok = lambda text, special: llm.tokenize(text.encode(), add_bos=False, special=special)  # noqa: E731
    return [{"text": t, "special": tok(t, True), "plain": tok(t, False)} for t in CORPUS]


def main():
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        from localkv.hub.pull import ensure_model

        path = str(ensure_model("smollm2-135m", progress=False))
    import llama_cpp

    head = {
        "model": Path(path).name,
        "reference": f"llama-cpp-python {llama_cpp.__version__}, tokenize(text, add_bos=False, special=...)",
    }
    cases = reference(path)
    # One case per line keeps the file reviewable and its diffs small.
    body = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(head, ensure_ascii=False)[:-1] + ',\n "cases": [\n' + body + "\n ]}\n")
    json.loads(OUT.read_text())  # the hand-joined file must still be valid JSON
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
