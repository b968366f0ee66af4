"""bench's peak-memory measurement: a child's ru_maxrss and sampled private memory, localkv run's
and the bound it is held to."""

import sys

import numpy as np
import pytest

from localkv.bench import rss, start
from tiny_model import write_gguf


def _alloc(mb: int) -> list[str]:
    return [sys.executable, "-c", f"import numpy as np; a = np.ones({mb} << 20, np.uint8); print(int(a.sum()))"]


def test_child_peak_sees_what_the_child_touched():
    ballast = np.ones(400 << 20, np.uint8)  # a parent larger than the child: never counted in it
    small, out = rss.child_peak(_alloc(8))
    big, _ = rss.child_peak(_alloc(200))
    assert out.strip() == str(8 << 20)
    assert small.rss < 150 << 20 < big.rss - small.rss  # this child alone: not its parent, not the largest so far
    del ballast


def _hold(mb: int, file: str) -> list[str]:
    # anonymous pages and a file's pages, both touched, held long enough to be sampled
    code = (
        "import mmap, time, numpy as np; f = open(%r, 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); "
        "s = sum(m[i] for i in range(0, len(m), 4096)); a = np.ones(%d << 20, np.uint8); time.sleep(0.5); print(s)"
    )
    return [sys.executable, "-c", code % (file, mb)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps_rollup is Linux's")
def test_private_memory_counts_anonymous_pages_not_a_mapped_files(tmp_path):
    data = tmp_path / "weights.bin"
    data.write_bytes(np.random.default_rng(0).integers(0, 255, 96 << 20, dtype=np.uint8).tobytes())
    small, _ = rss.child_peak(_hold(8, str(data)))
    big, _ = rss.child_peak(_hold(128, str(data)))
    assert small.rss > 96 << 20 and small.anon < 64 << 20  # the file's 96 MB: resident, not anonymous
    assert 112 << 20 < big.anon - small.anon < 128 << 20  # 128 MB against 8 MB of array: anonymous
    assert small.uss > 96 << 20  # the file's pages only this child maps count in USS


def test_child_failure_is_reported_with_its_last_words():
    with pytest.raises(RuntimeError, match="exited 3: boom"):
        rss.child_peak([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"])


def test_localkv_run_peak_and_its_bound(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", quant="Q8_0")
    peak = rss.localkv_peak(str(path), threads=1)
    assert peak.engine == "localkv" and peak.tokens > rss.N_GEN and peak.rss > 20 << 20
    assert 20 << 20 < peak.mem.anon < peak.rss
    assert rss.bound(100_000_000, 2_000_000) == 130_000_000 + 2_000_000 + rss.SLACK


def test_engine_start_is_timed_in_fresh_processes(tmp_path):
    model = str(write_gguf(tmp_path / "tiny.gguf"))
    times = start.engine_starts(model, threads=1, reps=2)
    assert len(times) == 2 and all(0 < t < 60 for t in times)
    line = start.summary(model, threads=1)
    (value,) = line.values()
    assert value.endswith(("holds", "MISSED")) and "goal 0.5 s" in value


def test_engine_start_failure_is_one_line(tmp_path):
    with pytest.raises(RuntimeError, match="engine start exited 1: .*"):
        start.engine_starts(str(tmp_path / "missing.gguf"), threads=1, reps=1)
