"""Loading the CPU kernels: one load() for every numba kernel of the backend (attention,
element-wise, the weight types' matmuls), the switch that turns them off, numba's
threading layer, the guard that drops numba's cache when any source here changed, and the one
record of what loaded (`state`).

Threads: numba's OpenMP layer starts a kernel at once (its workers spin between kernels); the
sleeping "workqueue" layer wakes its workers for each, which over the ~200 kernels of a step
costs more than it saves, so only "omp" is used. Spinning workers and OpenBLAS's own
spinning workers must not run at once on a small machine (a kernel start then waits for a time
slice), so while kernels run the model keeps BLAS on one thread (see CpuBackend.begin_forward),
and localkv/__init__ shortens OpenBLAS's spin after a call (OPENBLAS_THREAD_TIMEOUT) and that
of numba's OpenMP workers (GOMP_SPINCOUNT).

LOCALKV_CPU_KERNELS=0 turns the kernels off (numpy/BLAS only); so does a missing numba or a
missing OpenMP runtime (libgomp). Compiled code is cached beside the kernel files (numba's
cache), and each kernel module's self-checks (kernels.self_check) run as it loads: a group
that fails stays off and its callers take the numpy path.
"""

import hashlib
import os
import sys
import threading
import time
from collections.abc import Iterable
from functools import partial
from pathlib import Path

from localkv import kv_format
from localkv.backends.cpu.formats.types import BLOCK_TYPES, FLOAT_TYPES
from localkv.backends.cpu.loaded import state
from localkv.backends.cpu.numba_hooks import UNUSED_BY_NUMBA, absent, tables_deferred
from localkv.errors import LocalkvError, first_line

ROOT = Path(__file__).parent  # every .py file under it can be inlined into a cached kernel


_lock = threading.Lock()


def load(types: Iterable[str] = (), progress: bool = False, kv: Iterable[str] = ()) -> bool:
    """Import numba, pin its threading layer to OpenMP, and compile (or load from numba's
    cache) and self-check the element-wise kernels, the attention kernels of these K/V pools
    (kv: "K:V" format pairs, as kv_format.pair_name says them: a start loads only the builds
    its pool reads) and those of these weight types. True when all of them can run; otherwise
    those that can still do, and the others' reasons are kept (why_not, quant.why_not). Safe to
    call again. A compile (numba's cache missed) is shared with worker processes (warmup); with
    progress it is said on stderr before it starts, with a bar on a terminal."""
    types = sorted(set(types))
    for t in types:
        if t not in BLOCK_TYPES + FLOAT_TYPES:
            raise ValueError(f"weight type {t} is not supported")
    pools = sorted({_pool(p) for p in kv})
    with _lock:
        t0 = time.perf_counter()
        _switched_on()
        todo = [t for t in types if t not in state.types]
        if state.ok is False:
            state.types.update(dict.fromkeys(todo, state.why or "the CPU kernels are off"))
            return False
        jobs = _jobs(state.ok is None, todo, [p for p in pools if p not in state.kv])
        if jobs:
            compiled = _run(jobs, progress)
            if progress and compiled:
                took = time.perf_counter() - t0
                print(f"compiled the CPU kernels in {took:.1f} s (cached for later runs)", file=sys.stderr)
    return bool(state.ok) and all(state.types[t] is None for t in types)


def _pool(pair: str) -> str:
    """A pool's K/V formats as "K:V" (one name for both, or K:V), each a kv_format name."""
    return ":".join(f.name for f in kv_format.parse(pair))


def _pool_of(key: str) -> str:
    """The "K:V" pool of a kv job's key ("kv:K:V:check")."""
    return key.removeprefix("kv:").rsplit(":", 1)[0]


def load_in_background() -> threading.Thread:
    """load() of the kernels no weight type decides, in a daemon thread (started): the next
    load() waits for it. An error it raises (a bad LOCALKV_COMPILE_WORKERS) leaves them
    unloaded, and that next load() raises it again, in the caller's thread."""

    def quietly():
        try:
            load()
        except LocalkvError:
            pass

    thread = threading.Thread(target=quietly, name="localkv-kernels", daemon=True)
    thread.start()
    return thread


def active() -> bool:
    """The attention and element-wise kernels loaded and can run."""
    return bool(state.ok)


def usable() -> bool:
    """The kernels are switched on and numba imports: what a choice made before they compile
    goes by (--kv-dtype auto's pool, whose kernels then compile with the weights' at once). A
    self-check that fails later turns them off, and numpy runs what was chosen."""
    with _lock:
        return _switched_on()


def _switched_on() -> bool:
    """(Under _lock.) _numba() once a process: False, with state.why, when the kernels are off."""
    if state.ok is None and not state.imported:
        off = _numba()
        state.imported = off is None
        if off:
            state.ok, state.why = False, off
    return state.ok is not False


def why_not() -> str | None:
    return state.why


def _numba() -> str | None:
    """The switch, numba, its threading layer, the stale-cache guard and the kernel modules
    (their imports register the checks): None when all are in place, else why not."""
    if os.environ.get("LOCALKV_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return "LOCALKV_CPU_KERNELS=0"
    try:
        with absent(*UNUSED_BY_NUMBA):
            import numba
    except ImportError as e:
        return f"numba not installed ({e})"
    if not os.environ.get("NUMBA_THREADING_LAYER"):
        numba.config.THREADING_LAYER = "omp"
    try:
        drop_stale_cache()
        with absent("scipy.linalg"):
            from localkv.backends.cpu.kernels import attention, decode_rows, elementwise  # noqa: F401
    except Exception as e:  # a numba/numpy mismatch, an unwritable cache...
        return f"numba kernels unavailable ({type(e).__name__}: {first_line(e)})"
    return None


def _checks(group: str) -> list:
    """The checks of group ("base" or "weights"), in the order registered."""
    from localkv.backends.cpu.kernels import CHECKS

    return CHECKS[group]


def _jobs(base: bool, types: list[str], pools: list[str] = ()) -> list:
    """warmup's jobs: each base check (their kernels are disjoint), each kv check for each of
    these pools ("K:V"), and one for all these weight types (their checks compile the same
    kernels, in other signatures)."""
    from localkv.backends.cpu.warmup import Job

    jobs = [Job(f"base:{_name(c.run)}", c.cost, c.run) for c in _checks("base")] if base else []
    for pool in pools:
        pair = pool.split(":")
        jobs += [Job(f"kv:{pool}:{_name(c.run)}", c.cost, partial(c.run, *pair)) for c in _checks("kv")]
    if types:
        try:
            import localkv.backends.cpu.quant.compiled  # noqa: F401  (its import registers the checks)
        except Exception:  # _load_types says why
            pass
        cost = sum(c.cost for c in _checks("weights"))
        jobs.append(Job("weights:" + ",".join(types), cost * len(types), lambda: _load_types(types)))
    return jobs


def _name(check) -> str:
    return f"{check.__module__.rsplit('.', 1)[-1]}.{check.__name__}"


def _run(jobs: list, progress: bool) -> bool:
    """Run the jobs (warmup, under _lock) and keep what the base and kv checks found. True
    when something compiled."""
    import localkv.backends.cpu.warmup as warmup

    with absent("scipy.linalg"), tables_deferred():
        results, compiled = warmup.run(jobs, _WORKER, progress, warmup.setting())  # a bad setting: raised now
    base = {k: r for k, r in results.items() if k.startswith("base:")}
    if base:
        _kept_base(base)
    _kept_pools(results)
    return compiled


def _kept_base(base: dict):
    failed = [r for r in base.values() if isinstance(r, Exception)]
    if failed:
        state.ok, state.why = False, f"numba kernels unavailable ({type(failed[0]).__name__}: {first_line(failed[0])})"
    elif not all(base.values()):
        state.ok, state.why = False, "kernel self-check failed"
    elif why := _threading_not_omp():
        state.ok, state.why = False, why
    else:
        from localkv.backends.cpu.kernels import attention, decode_rows, elementwise

        state.ok, state.why = True, None
        state.attention, state.decode_rows, state.elementwise = attention, decode_rows, elementwise
    if not state.ok:
        state.types.update(dict.fromkeys(state.types, state.why))


def _kept_pools(results: dict):
    """Each pool whose kv checks ran: None when all passed, else why not. A pool that fails
    turns the kernels off (its rows then take numpy's path)."""
    for key, r in results.items():
        if not key.startswith("kv:"):
            continue
        pool = _pool_of(key)
        state.kv.setdefault(pool, None)
        if state.kv[pool] is None and (isinstance(r, Exception) or not r):
            why = f"{type(r).__name__}: {first_line(r)}" if isinstance(r, Exception) else "failed"
            state.kv[pool] = f"the kernel self-check of a {pool} pool: {why}"
    bad = next((why for why in state.kv.values() if why), None) or _threading_not_omp()
    if bad and state.ok:
        state.ok, state.why = False, bad
        state.types.update(dict.fromkeys(state.types, bad))


def _threading_not_omp() -> str | None:
    """Why numba's threading layer is not OpenMP (see the docstring), None when it is or when
    no parallel kernel has run yet (none of the base checks' kernels is parallel: the pools'
    checks start the layer)."""
    import numba

    try:
        layer = numba.threading_layer()
    except ValueError:  # not started yet
        return None
    return None if layer == "omp" else f"numba threading layer {layer!r}, not 'omp'"


# a worker process of warmup: compiles the jobs whose keys follow
_WORKER = [sys.executable, "-m", "localkv.backends.cpu.compile_worker"]


def run_in_worker(keys: list[str]) -> int:
    """In a worker process of warmup: compile (or load) the jobs of these keys into numba's
    cache, printing `done KEY` as each is in it. Their results are not kept: the process that
    started this one loads and checks each itself."""
    off = _numba()
    if off:
        print(off, file=sys.stderr)
        return 1
    types = [k.removeprefix("weights:").split(",") for k in keys if k.startswith("weights:")]
    pools = sorted({_pool_of(k) for k in keys if k.startswith("kv:")})
    jobs = {j.key: j for j in _jobs(True, types[0] if types else [], pools)}
    with absent("scipy.linalg"):
        for key in keys:
            try:
                jobs[key].run()
            except Exception as e:  # the parent's own run of it reports the failure
                print(f"{key}: {type(e).__name__}: {first_line(e)}", file=sys.stderr)
            print(f"done {key}", flush=True)
    return 0


def _load_types(types: list[str]):
    """The weight kernels of these types (called under _lock, with numba's tables deferred)."""
    try:
        import localkv.backends.cpu.quant.compiled as weights  # its import registers the checks
    except Exception as e:  # a numba/llvm mismatch...
        state.types.update(dict.fromkeys(types, f"weight kernels unavailable ({type(e).__name__}: {first_line(e)})"))
        return
    for t in types:
        state.types[t] = _passes("weights", t, f"{t} kernel")
    if any(state.types[t] is None for t in types):
        state.weights = weights


def _passes(group: str, qtype: str, what: str) -> str | None:
    """None when the self-checks of `group` pass for qtype, else why not."""
    try:
        return None if all(check.run(qtype) for check in _checks(group)) else f"{what} self-check failed"
    except Exception as e:  # a numba/llvm mismatch, an unwritable cache...
        return f"{what}s unavailable ({type(e).__name__}: {first_line(e)})"


def drop_stale_cache(root: Path = ROOT, constants: Path = Path(kv_format.__file__)) -> bool:
    """numba's cache knows only the file of the kernel it compiled, not the SIMD helpers,
    decoders and other kernels it inlined from the other files here, nor kv_format's
    constants it froze in (the blocks' sizes, the encoder's divisors): drop every cached
    kernel under root when any .py file under it or `constants` (kv_format.py) changed (its
    name or its text). True when it did."""
    digest = hashlib.sha1()
    for p in sorted(root.rglob("*.py")):
        digest.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    digest.update(b"kv_format.py\0" + constants.read_bytes())
    stamp = root / "__pycache__" / "kernel_sources.sha1"
    try:
        if stamp.exists() and stamp.read_text() == digest.hexdigest():
            return False
        for p in root.rglob("__pycache__/*.nb[ic]"):
            p.unlink(missing_ok=True)
        stamp.parent.mkdir(exist_ok=True)
        stamp.write_text(digest.hexdigest())
    except OSError:  # a read-only install: numba caches elsewhere, keyed on the files' times
        pass
    return True
