"""llama.cpp (through llama-cpp-python) as the reference engine for `localkv bench --vs llama.cpp`.

It runs the same GGUF with the same thread count and exposes the same pp/tg timers as
bench.LocalRunner, so the two can be interleaved rep by rep.
"""

import importlib.util
from pathlib import Path
from time import perf_counter

import numpy as np

from .errors import LocalkvError

INSTALL_HINT = "pip install -e '.[peer]'"


def peer_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class PeerRunner:
    name = "llama.cpp"

    def __init__(self, path: str | Path, threads: int, n_ctx: int):
        if not peer_available():
            raise LocalkvError(f"--vs llama.cpp needs llama-cpp-python, which is not installed ({INSTALL_HINT})")
        import llama_cpp

        try:
            # n_batch = n_ubatch = 512 and no logits_all: what llama-bench runs by default
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads,
                                       n_threads_batch=threads, n_batch=512, n_ubatch=512,
                                       logits_all=False, verbose=False)
        except Exception as e:  # llama.cpp reports load failures as ValueError/RuntimeError
            raise LocalkvError(f"llama.cpp could not load {path}: {e}") from None
        self.n_vocab = self.llm.n_vocab()

    def _reset(self):
        # reset() only rewinds n_tokens; clear the KV too so each rep starts from an empty cache
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()

    def _argmax(self) -> int:
        # without logits_all, llama.cpp keeps one logits row: the last evaluated token's
        return int(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,)).argmax())

    def pp(self, tokens: list[int]) -> float:
        self._reset()
        t0 = perf_counter()
        self.llm.eval(tokens)
        return perf_counter() - t0

    def tg(self, first: int, n: int) -> float:
        self._reset()
        self.llm.eval([first])
        t0 = perf_counter()
        for _ in range(n):
            self.llm.eval([self._argmax()])
        return perf_counter() - t0

    def close(self):
        self.llm.close()
