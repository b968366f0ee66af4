"""Q4_K and Q6_K on their packed form (formats/packed, kernels/superblock_packed): every row the bits
of the row kernel (superblock.matmul_rows, the one arithmetic's definition) for any row count,
partial row groups and several weights in one call; and the packed form kept on disk
(quant/pack_cache): written once, mapped after, repacked when damaged, in memory when the
folder cannot be written."""

import os

import numpy as np
import pytest

from localkv.backends.cpu import build, quant
from localkv.backends.cpu.formats.blocks import MARKERS
from localkv.backends.cpu.quant import pack_cache
from localkv.backends.cpu.quant.tensor import QStack, sample_weight

TYPES = ("Q4_K", "Q6_K")


@pytest.fixture(scope="module")
def kernels():
    assert build.load(TYPES), {t: quant.why_not(t) for t in TYPES}
    from localkv.backends.cpu.kernels import superblock, superblock_packed

    return superblock, superblock_packed


def weights(qtype: str) -> QStack:
    """Three matrices of 3 super-blocks: 37 rows (two full row groups and 5), 16, 3."""
    return QStack(tuple(sample_weight(qtype, rows, 768, seed) for rows, seed in ((37, 1), (16, 2), (3, 3))))


@pytest.mark.parametrize("qtype", TYPES)
def test_the_packed_kernel_gives_every_row_the_row_kernels_bits(kernels, qtype):
    superblock, superblock_packed = kernels
    w, rng = weights(qtype), np.random.default_rng(5)
    (run,), qt = w.runs, MARKERS[qtype]
    for rows in (1, 2, 3, 4, 5, 8, 9, 13, 17):
        for positive in (False, True):  # positive: large sums whose float steps round
            x = rng.uniform(0.5, 1, (rows, w.cols)) if positive else rng.standard_normal((rows, w.cols))
            x = (x * rng.uniform(0.1, 10, (rows, 1))).astype(np.float32)
            x[rows // 2, 300] = np.inf  # its super-block: nan
            want = np.empty((rows, w.rows), np.float32)
            superblock.matmul_rows(qt, x, run.datas, run.offs, want)
            got = np.full((rows, w.rows), -1, np.float32)
            superblock_packed.matmul_packed(qt, x, run.datas, run.packed(), run.offs, got)
            assert np.array_equal(got, want, equal_nan=True), (rows, positive)
            assert np.isnan(got[rows // 2]).all()


def test_a_packed_form_of_another_shape_is_refused():
    a, b = sample_weight("Q4_K", 20, 512, 1), sample_weight("Q4_K", 40, 512, 1)
    with pytest.raises(ValueError, match="packed Q4_K"):
        a.use_packed(b.packed())


def test_the_packed_form_is_written_once_then_mapped(kernels, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALKV_HOME", str(tmp_path))
    x = np.random.default_rng(2).standard_normal((3, 768)).astype(np.float32)
    fresh = {"w": weights("Q4_K"), "h": sample_weight("Q6_K", 20, 768, 4)}
    want = {k: quant.matmul_rows(x, w) for k, w in fresh.items()}  # packed in memory
    ws = {"w": weights("Q4_K"), "h": sample_weight("Q6_K", 20, 768, 4)}
    quant.pack(ws, "f" * 64)
    files = sorted(os.listdir(pack_cache.folder("f" * 64)))
    assert files == ["h.0.q6_k", "w.0.q4_k", "w.1.q4_k", "w.2.q4_k"]
    again = {"w": weights("Q4_K"), "h": sample_weight("Q6_K", 20, 768, 4)}
    quant.pack(again, "f" * 64)
    p = again["h"].packed()
    assert isinstance(p.base, np.memmap) and not p.flags.writeable  # mapped, not packed again
    for k in want:
        assert np.array_equal(quant.matmul_rows(x, again[k]), want[k])
    path = pack_cache.folder("f" * 64) / "h.0.q6_k"
    path.write_bytes(path.read_bytes()[:100])  # damaged: another size, packed again and rewritten
    third = {"h": sample_weight("Q6_K", 20, 768, 4)}
    quant.pack(third, "f" * 64)
    assert path.stat().st_size == third["h"].packed().nbytes
    assert np.array_equal(quant.matmul_rows(x, third["h"]), want["h"])
    assert pack_cache.remove("f" * 64) > 0 and not pack_cache.folder("f" * 64).exists()


def test_a_folder_that_cannot_be_written_keeps_the_packed_form_in_memory(kernels, tmp_path, monkeypatch):
    (tmp_path / "packed").write_text("a file where the folder would be")
    monkeypatch.setenv("LOCALKV_HOME", str(tmp_path))
    ws = {"h": sample_weight("Q6_K", 20, 768, 4)}
    quant.pack(ws, "e" * 64)
    assert not isinstance(ws["h"].packed().base, np.memmap)
    x = np.random.default_rng(3).standard_normal((2, 768)).astype(np.float32)
    assert np.array_equal(quant.matmul_rows(x, ws["h"]), quant.matmul_rows(x, sample_weight("Q6_K", 20, 768, 4)))
