"""The bytes a speed test moves, the read probe, and the rows and targets they give."""

import numpy as np
import pytest

from localkv.backends.cpu.quant import QStack
from localkv.backends.cpu.quant.tensor import sample_weight
from localkv.bench import bandwidth, speed


def _weights(tied: bool) -> dict:
    w = {
        "tok_embd": sample_weight("Q8_0", 64, 32),
        "out_norm": np.ones(32, np.float32),
        "0.attn_norm": np.ones(32, np.float32),
        "0.wqkv": QStack((sample_weight("Q4_0", 32, 32), sample_weight("Q4_0", 16, 32))),
        "0.wo": sample_weight("Q4_K", 32, 256),
    }
    if not tied:
        w["output"] = sample_weight("Q6_K", 64, 256)
    return w


def test_weight_bytes_count_the_matrices_and_the_head_not_the_embedding_lookup():
    w = _weights(tied=True)
    mats = sum(t.data.nbytes for t in w["0.wqkv"].tensors) + w["0.wo"].data.nbytes
    assert bandwidth.weight_bytes(w) == mats + w["tok_embd"].data.nbytes  # tied: the table is the head
    w = _weights(tied=False)
    assert bandwidth.weight_bytes(w) == mats + w["output"].data.nbytes


def test_each_pass_reads_the_context_it_attends_over():
    assert bandwidth.passes(10, 0, 3, 512) == [12, 13, 14]  # the first token ran before the clock
    assert bandwidth.passes(5, 1000, 0, 512) == [517, 1005]
    assert bandwidth.passes(0, 512, 0, 512) == [512]
    assert bandwidth.bytes_moved(10, 0, 3, 512, weights=1000, kv_per_token=7) == 3 * 1000 + (12 + 13 + 14) * 7


def test_the_probe_reads_every_word():
    words = np.arange(1, 10_001, dtype=np.uint64)
    assert bandwidth._sum_words(words, 16) == words.sum()  # 10,000 = 16 x 625: every part counted


def test_probe_buffer_is_well_past_the_cache():
    probe = bandwidth.ReadProbe(1, 8 << 20)
    try:
        assert probe.nbytes <= 8 << 20 and probe.nbytes % (8 * probe.parts) == 0 and probe.gbps(0.05) > 0
    finally:
        probe.close()
    assert bandwidth.PROBE_MIN_BYTES >= 256 << 20 and bandwidth._llc_bytes() >= 0


def _tg_row(share, depth=0, engine="localkv"):
    return {"engine": engine, "test": "tg128", "n_gen": 128, "n_depth": depth, "probe_share": share}


@pytest.mark.parametrize(("quant", "share", "ok"), [("Q4_K", 0.86, True), ("Q4_K", 0.84, False), ("Q8_0", 0.81, True)])
def test_probe_share_targets_judge_tg_at_depth_0(quant, share, ok):
    rows = [_tg_row(0.5, engine="llama.cpp"), _tg_row(share), _tg_row(0.1, depth=4096)]
    (t,) = speed._targets(rows, quant, judged=True)
    assert t.ok is ok and t.value == f"{share * 100:.0f}%"
    assert speed._targets(rows, quant, judged=False)[0].ok is None
    assert speed._targets(rows, "Q4_1", judged=True) == []  # the issue names no goal for it


def test_probe_runs_on_the_threads_the_kernels_would_get(monkeypatch):
    # on a loaded machine CoreShare gives fewer threads than asked; the probe follows it
    probe = bandwidth.ReadProbe(2, 8 << 20)
    seen = []
    monkeypatch.setattr(bandwidth.numba, "set_num_threads", seen.append)
    monkeypatch.setattr(probe.cores, "threads", lambda: 1)
    try:
        probe.gbps(0.0)
    finally:
        probe.close()
    assert seen[0] == 1
