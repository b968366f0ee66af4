"""llama.cpp (through llama-cpp-python) as the reference engine for `localkv bench --vs llama.cpp`.

It runs the same GGUF with the same thread count and exposes the same pp/tg timers as
speed.LocalRunner, so the two can be interleaved rep by rep; branches() is best-of-N the way
llama.cpp's Python API does it (the fork suite). The cache suite times llama.cpp's first token
in a fresh process: child_ttft_peer.py.
"""

import importlib.util
import os
from pathlib import Path
from time import perf_counter

import numpy as np

import localkv
from localkv.errors import LocalkvError
from localkv.kv_format import F16, KvFormat

INSTALL_HINT = "pip install -e '.[peer]'"
PEERS = ("llama.cpp",)  # what --vs accepts
_GGML_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # llama.cpp's ggml_type of each K/V format (type_k / type_v)


def check_vs(vs: str | None):
    if vs is not None and vs not in PEERS:
        raise LocalkvError(f"unknown --vs {vs!r}: the only engine to compare against is llama.cpp")


def peer_env() -> dict[str, str]:
    """The environment of a peer engine's own process: this one's, less the worker-spin
    settings localkv made for itself (localkv/__init__; values the user set are kept). A peer
    process that imports localkv (child_ttft_peer) drops them again with drop_own_env()."""
    return {k: v for k, v in os.environ.items() if k not in localkv.DEFAULTED_ENV}


def drop_own_env():
    """In a peer's process that imported localkv: unset what localkv's import set and the
    environment did not, before the peer's libraries read it."""
    for key in localkv.DEFAULTED_ENV:
        os.environ.pop(key, None)


def peer_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def peer_problem() -> str | None:
    """Why llama-cpp-python cannot serve as the peer here, or None. Besides a missing install: a
    build with llama.cpp's AMX matmul on a CPU that has AMX, which segfaults at the first prompt
    on some Xeons (ggml-org/llama.cpp#20824); scripts/install_dev.sh builds it without."""
    if not peer_available():
        return f"llama-cpp-python is not installed ({INSTALL_HINT})"
    import llama_cpp

    built_with = "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode(errors="replace")
    if built_with and _cpu_has("amx_int8"):
        return (
            "llama-cpp-python was built with llama.cpp's AMX matmul, which crashes on some CPUs with AMX "
            "(ggml-org/llama.cpp#20824): rebuild it without with `bash scripts/install_dev.sh`"
        )
    return None


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


class PeerRunner:
    name = "llama.cpp"
    chunk = 512  # n_batch: prompt tokens per pass
    kv_format = kv_format_v = F16  # llama.cpp's default K and V type
    flash_attn = False  # llama-cpp-python's default; each row says it

    def __init__(
        self,
        path: str | Path,
        threads: int,
        n_ctx: int,
        prompt_lookup: bool = False,
        kv: tuple[KvFormat, KvFormat] | None = None,
        logits_all: bool = False,
    ):
        """prompt_lookup: llama-cpp-python's LlamaPromptLookupDecoding as the draft model, at its
        defaults (as a new user would set it up; it turns on logits for every position). kv: the
        K and V formats (type_k / type_v) with flash attention on, which a quantized V needs;
        None: llama.cpp's defaults. logits_all: keep every position's logits (llm.scores)."""
        why = peer_problem()
        if why:
            raise LocalkvError(f"--vs llama.cpp: {why}")
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding() if prompt_lookup else None
        if kv is not None:
            self.kv_format, self.kv_format_v, self.flash_attn = kv[0], kv[1], True
        types = {} if kv is None else {"type_k": _GGML_TYPES[kv[0].name], "type_v": _GGML_TYPES[kv[1].name]}
        try:
            # n_batch = n_ubatch = 512 and no logits_all: what llama-bench runs by default
            self.llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_threads=threads,
                n_threads_batch=threads,
                n_batch=self.chunk,
                n_ubatch=self.chunk,
                flash_attn=self.flash_attn,
                # with a draft model llama-cpp-python keeps logits for every position but sizes
                # their buffer by this flag (n_batch rows without it): past 512 tokens it overflows
                logits_all=prompt_lookup or logits_all,
                draft_model=draft,
                verbose=False,
                **types,
            )
        except Exception as e:  # llama.cpp reports load failures as ValueError/RuntimeError
            raise LocalkvError(f"llama.cpp could not load {path}: {e}") from None
        self.n_vocab = self.llm.n_vocab()
        self.depth = 0  # tokens every pp/tg rep starts after (set_depth)

    def set_depth(self, tokens: list[int]):
        """pp and tg from now on start after these tokens, evaluated once here."""
        self.depth = 0
        self._reset()
        if tokens:
            self.llm.eval(tokens)
            self.depth = len(tokens)

    def _reset(self):
        # reset() only rewinds n_tokens; clear the KV too so each rep starts from an empty cache.
        # At a depth, rewinding to it is enough: eval() drops the K/V past n_tokens first
        if self.depth:
            self.llm.n_tokens = self.depth
            return
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()

    def _argmax(self) -> int:
        # without logits_all, llama.cpp keeps one logits row: the last evaluated token's
        return int(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,)).argmax())

    def forced(self, tokens: list[int]) -> np.ndarray:
        """The logits of every one of these tokens, evaluated after those already in the K/V
        (teacher forcing; needs logits_all)."""
        start = self.llm.n_tokens
        self.llm.eval(tokens)
        return self.llm.scores[start : start + len(tokens)]

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

    def branches(
        self,
        prompt: list[int],
        n: int,
        max_tokens: int,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        seed: int = 0,
    ) -> dict:
        """n replies to one prompt, one after another, reusing the prompt's state: eval the prompt
        once, save_state(), then per branch load_state() and sample max_tokens tokens (EOS is not
        a stop: every branch has max_tokens tokens). decode_s sums the sampling + eval loops only;
        the prompt, the save and the restores are timed apart."""
        llm = self.llm
        self._reset()
        t = perf_counter()
        llm.eval(prompt)
        prompt_s = perf_counter() - t
        t = perf_counter()
        state = llm.save_state()
        save_s = perf_counter() - t
        restore_s = decode_s = 0.0
        outs = []
        try:
            for i in range(n):
                t = perf_counter()
                llm.load_state(state)
                restore_s += perf_counter() - t
                llm.set_seed(seed + i)
                # one sampler per branch (sample() alone would build a new chain per token); min_p 0:
                # the same top-k / top-p / temperature chain as localkv's sampler
                llm._sampler = llm._init_sampler(top_k=top_k, top_p=top_p, min_p=0.0, temp=temperature)
                out = []
                t = perf_counter()
                for j in range(max_tokens):
                    tok = llm.sample()
                    out.append(tok)
                    if j + 1 < max_tokens:
                        llm.eval([tok])
                decode_s += perf_counter() - t
                outs.append(out)
        finally:
            llm._sampler = None
        return {
            "prompt_s": prompt_s,
            "save_s": save_s,
            "restore_s": restore_s,
            "decode_s": decode_s,
            "state_bytes": int(state.llama_state_size),
            "tokens": outs,
        }

    def greedy(self, prompt: list[int], n: int) -> dict:
        """n greedy tokens after prompt through Llama.generate (where its draft model, if any,
        drafts and verifies): the tokens and the decode seconds, from the first token to the last."""
        self._reset()
        out, t_first = [], 0.0
        for tok in self.llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            out.append(tok)
            if len(out) == 1:
                t_first = perf_counter()
            if len(out) == n:
                break
        return {"tokens": out, "decode_s": perf_counter() - t_first}

    def close(self):
        self.llm.close()
