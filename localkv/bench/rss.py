"""Peak memory of `localkv run -n 16` in a fresh process, and of llama-cpp-python doing the
same work on the same GGUF: resident (ru_maxrss from wait4, as /usr/bin/time reports it) and
private.

RSS counts the pages of the memory-mapped model a process has touched, its heap, its libraries;
the issue's bound for localkv is 1.3 x the GGUF + the K/V the run holds + 150 MB. But a mapped
file's clean pages are page cache, shared and dropped under pressure: the memory a process
costs the machine is its private anonymous pages (heap, K/V, buffers, copies of a library's
relocated pages), smaps_rollup's Pss_Anon. USS (Private_Clean + Private_Dirty) is shown beside
it: it also counts clean file pages no other process maps (this run's model pages). The kernel
keeps no high-water mark of either, so the launcher samples them every SAMPLE_S while the
child runs; a spike shorter than that can be missed. Each localkv child gets a private
LOCALKV_HOME (no conversation log, no disk cache written into the user's).
"""

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from localkv.bench.peer import peer_env
from localkv.bench.report import Target

PROMPT = "Write a short story about a robot who learns to paint."
N_GEN = 16
SLACK = 150_000_000  # bytes: the interpreter, numpy, numba and the tokenizer
FACTOR = 1.3
PRIVATE_GOAL = 1.0  # issue 32: peak private memory of localkv / llama.cpp's
SAMPLE_S = 0.02

_PEER = """
import json, sys, llama_cpp
path, threads, prompt, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
out = llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=n, temperature=0)
use = out["usage"]
print(json.dumps({"prompt_tokens": use["prompt_tokens"], "completion_tokens": use["completion_tokens"]}))
"""


@dataclass(slots=True, frozen=True)
class Mem:
    """A child's peaks in bytes; anon and uss are None where smaps_rollup could not be read."""

    rss: int
    anon: int | None = None  # private anonymous: Pss_Anon
    uss: int | None = None  # Private_Clean + Private_Dirty


@dataclass(slots=True, frozen=True)
class Peak:
    engine: str
    mem: Mem
    tokens: int  # prompt + generated tokens the run held

    @property
    def rss(self) -> int:
        return self.mem.rss


# Runs argv and reports its peaks. A child made by fork or vfork inherits its parent's memory
# high-water mark until it execs (Linux folds the old mm's into ru_maxrss), so a bench process
# holding a model would be counted in every child: this small launcher stands in between.
_LAUNCHER = """
import os, sys, time
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
anon = uss = -1
while True:
    done, status, usage = os.wait4(pid, os.WNOHANG)
    if done:
        break
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            kb = {k[:-1]: int(v) for k, v, *_ in (line.split() for line in f) if k.endswith(":")}
        anon = max(anon, kb.get("Pss_Anon", kb.get("Anonymous", -1)))
        uss = max(uss, kb["Private_Clean"] + kb["Private_Dirty"])
    except (OSError, ValueError, KeyError):
        pass
    time.sleep(float(sys.argv[1]))
print(f"\\nlocalkv-peak-kb {usage.ru_maxrss} {anon} {uss}", file=sys.stderr)
sys.exit(os.waitstatus_to_exitcode(status))
"""
_MARK = "localkv-peak-kb "


def child_peak(argv: list[str], env: dict | None = None) -> tuple[Mem, str]:
    """(peak memory, stdout) of a process running argv (argv[0] a path); raises RuntimeError
    with the child's last stderr line when it fails."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        launcher = [sys.executable, "-S", "-c", _LAUNCHER, str(SAMPLE_S)]
        proc = subprocess.run(launcher + argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
        out.seek(0)
        err.seek(0)
        text, why = out.read().decode(errors="replace"), err.read().decode(errors="replace").strip()
    lines = [line for line in why.splitlines() if line.strip()] or [""]
    last = lines[-1]
    if proc.returncode != 0 or not last.startswith(_MARK):
        said = lines[-2] if last.startswith(_MARK) and len(lines) > 1 else last
        raise RuntimeError(f"{Path(argv[0]).name} exited {proc.returncode}: {said[-300:]}")
    rss, anon, uss = (int(x) * 1024 if int(x) >= 0 else None for x in last.split()[1:])  # Linux says kB
    return Mem(rss, anon, uss), text


def localkv_peak(model: str, threads: int) -> Peak:
    """A second run's peak: the first, in the same private home, writes the packed K-quant
    weights (LOCALKV_HOME/packed) that every later run maps."""
    with tempfile.TemporaryDirectory() as home:
        env = dict(os.environ, LOCALKV_HOME=home)
        argv = [sys.executable, "-m", "localkv", "run", "-m", model, "-n", str(N_GEN), "-t", "0", "--json"]
        argv += ["--threads", str(threads), "--no-save", PROMPT]
        child_peak(argv, env)
        mem, text = child_peak(argv, env)
    r = json.loads(text.strip().splitlines()[-1])
    return Peak("localkv", mem, r["prompt_tokens"] + r["completion_tokens"])


def peer_peak(model: str, threads: int) -> Peak:
    mem, text = child_peak([sys.executable, "-c", _PEER, model, str(threads), PROMPT, str(N_GEN)], peer_env())
    r = json.loads(text.strip().splitlines()[-1])
    return Peak("llama.cpp", mem, r["prompt_tokens"] + r["completion_tokens"])


def bound(model_bytes: int, kv_bytes: int) -> int:
    """The issue's ceiling on localkv's peak RSS."""
    return int(FACTOR * model_bytes + kv_bytes + SLACK)


def summary(model: Path, kv_bytes_per_token: int, threads: int, vs: str | None) -> tuple[dict[str, str], list[Target]]:
    """Report lines (each engine's peaks, localkv's RSS bound, the ratios to llama.cpp) and the
    private-memory target (judged only beside llama.cpp)."""
    mine = localkv_peak(str(model), threads)
    used_kv = mine.tokens * kv_bytes_per_token
    limit = bound(model.stat().st_size, used_kv)
    verdict = "holds" if mine.rss <= limit else "MISSED"
    held = f"{mine.tokens} tokens, K/V {used_kv / 1e6:.1f} MB"
    out = {
        f"peak RSS, localkv run -n {N_GEN}": f"{mine.rss / 1e6:.0f} MB ({held})",
        "peak RSS bound (1.3 x GGUF + K/V + 150 MB)": f"{limit / 1e6:.0f} MB: {verdict}",
        f"peak private, localkv run -n {N_GEN}": _private(mine.mem),
    }
    if not vs:
        return out, []
    peer = peer_peak(str(model), threads)
    out[f"peak RSS, llama.cpp -n {N_GEN}"] = f"{peer.rss / 1e6:.0f} MB"
    out[f"peak private, llama.cpp -n {N_GEN}"] = _private(peer.mem)
    out["peak RSS localkv / llama.cpp"] = f"{mine.rss / peer.rss:.2f}x"
    x = mine.mem.anon / peer.mem.anon if mine.mem.anon and peer.mem.anon else None
    value = f"{x:.2f}x" if x is not None else "not sampled"
    goal = f"<= {PRIVATE_GOAL:.1f}x"
    return out, [
        Target(
            "peak private (anonymous) memory, localkv / llama.cpp",
            value,
            goal,
            None if x is None else x <= PRIVATE_GOAL,
        )
    ]


def _private(m: Mem) -> str:
    if m.anon is None:
        return "not sampled (no /proc/PID/smaps_rollup)"
    return f"{m.anon / 1e6:.0f} MB anonymous (USS {m.uss / 1e6:.0f} MB)"
