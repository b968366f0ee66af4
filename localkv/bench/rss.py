"""Peak resident memory of `localkv run -n 16` in a fresh process, as /usr/bin/time reports it
(ru_maxrss from wait4), and of llama-cpp-python doing the same work on the same GGUF.

RSS counts the pages of the memory-mapped model a process has touched, its heap, its libraries;
the issue's bound for localkv is 1.3 x the GGUF + the K/V the run holds + 150 MB. Each child
gets a private LOCALKV_HOME (no conversation log, no disk cache written into the user's).
"""

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from localkv.bench.peer import peer_env

PROMPT = "Write a short story about a robot who learns to paint."
N_GEN = 16
SLACK = 150_000_000  # bytes: the interpreter, numpy, numba and the tokenizer
FACTOR = 1.3

_PEER = """
import json, sys, llama_cpp
path, threads, prompt, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
out = llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=n, temperature=0)
use = out["usage"]
print(json.dumps({"prompt_tokens": use["prompt_tokens"], "completion_tokens": use["completion_tokens"]}))
"""


@dataclass(slots=True, frozen=True)
class Peak:
    engine: str
    rss: int  # bytes
    tokens: int  # prompt + generated tokens the run held


# Runs argv and reports its peak RSS. A child made by fork or vfork inherits its parent's memory
# high-water mark until it execs (Linux folds the old mm's into ru_maxrss), so a bench process
# holding a model would be counted in every child: this small launcher stands in between.
_LAUNCHER = """
import os, sys
pid = os.posix_spawn(sys.argv[1], sys.argv[1:], os.environ)
_, status, usage = os.wait4(pid, 0)
print(f"\\nlocalkv-maxrss-kb {usage.ru_maxrss}", file=sys.stderr)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def child_peak(argv: list[str], env: dict | None = None) -> tuple[int, str]:
    """(peak RSS in bytes, stdout) of a process running argv (argv[0] a path); raises
    RuntimeError with the child's last stderr line when it fails."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        launcher = [sys.executable, "-S", "-c", _LAUNCHER]
        proc = subprocess.run(launcher + argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
        out.seek(0)
        err.seek(0)
        text, why = out.read().decode(errors="replace"), err.read().decode(errors="replace").strip()
    lines = [line for line in why.splitlines() if line.strip()] or [""]
    last = lines[-1]
    if proc.returncode != 0 or not last.startswith("localkv-maxrss-kb "):
        said = lines[-2] if last.startswith("localkv-maxrss-kb ") and len(lines) > 1 else last
        raise RuntimeError(f"{Path(argv[0]).name} exited {proc.returncode}: {said[-300:]}")
    return int(last.split()[1]) * 1024, text  # Linux reports kilobytes


def localkv_peak(model: str, threads: int) -> Peak:
    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, LOCALKV_HOME=home)
        argv = [sys.executable, "-m", "localkv", "run", "-m", model, "-n", str(N_GEN), "-t", "0", "--json"]
        argv += ["--threads", str(threads), "--no-save", PROMPT]
        rss, text = child_peak(argv, env)
    r = json.loads(text.strip().splitlines()[-1])
    return Peak("localkv", rss, r["prompt_tokens"] + r["completion_tokens"])


def peer_peak(model: str, threads: int) -> Peak:
    rss, text = child_peak([sys.executable, "-c", _PEER, model, str(threads), PROMPT, str(N_GEN)], peer_env())
    r = json.loads(text.strip().splitlines()[-1])
    return Peak("llama.cpp", rss, r["prompt_tokens"] + r["completion_tokens"])


def bound(model_bytes: int, kv_bytes: int) -> int:
    """The issue's ceiling on localkv's peak RSS."""
    return int(FACTOR * model_bytes + kv_bytes + SLACK)


def summary(model: Path, kv_bytes_per_token: int, threads: int, vs: str | None) -> dict[str, str]:
    """Report lines: each engine's peak RSS, localkv's bound, and the ratio to llama.cpp."""
    mine = localkv_peak(str(model), threads)
    used_kv = mine.tokens * kv_bytes_per_token
    limit = bound(model.stat().st_size, used_kv)
    verdict = "holds" if mine.rss <= limit else "MISSED"
    held = f"{mine.tokens} tokens, K/V {used_kv / 1e6:.1f} MB"
    out = {
        f"peak RSS, localkv run -n {N_GEN}": f"{mine.rss / 1e6:.0f} MB ({held})",
        "peak RSS bound (1.3 x GGUF + K/V + 150 MB)": f"{limit / 1e6:.0f} MB: {verdict}",
    }
    if vs:
        peer = peer_peak(str(model), threads)
        out[f"peak RSS, llama.cpp -n {N_GEN}"] = f"{peer.rss / 1e6:.0f} MB"
        out["peak RSS localkv / llama.cpp"] = f"{mine.rss / peer.rss:.2f}x"
    return out
