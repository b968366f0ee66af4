"""The whole engine on the CUDA backend with the real SmolLM2-135M (Q4_1 layers, Q8_0 embedding
and tied output): on a GPU when CuPy sees one, else on the CPU through the CuPy stand-in and the
CUDA emulator. Compared with the CPU backend on the same requests.

What differs between the two, and how the tests handle it: the CUDA backend keeps activations and
the residual stream in fp16 and multiplies them by exactly decoded weights (fp16 tiles in
prefill); the CPU backend keeps fp32, but its decode steps (1-8 rows) round the activations to
int8 steps per 32 values, as llama.cpp does. Measured here: teacher-forced short prompts, the
CUDA logits stay within 0.02-0.15 of the CPU's exact (prefill) logits, the CPU's own decode
logits move by up to about 1.2; and this model is sensitive: two fp32 CPU runs of one text that
only chunk the prompt differently (16 or 32 rows) differ by up to 0.9 in a logit. So greedy text
parts wherever the top two tokens lie that close: of six chat prompts, two parted at the first
token (top two 0.07-0.08 apart), one at token 17, one at 31; so greedy texts may part only
where the CPU's top two tokens lie within 0.35, and other logits are compared by _agree (top-1, or near-ties; softmax
distance), not by raw values. Forks are checked against the CUDA backend's own greedy run.
"""

from pathlib import Path

import numpy as np
import pytest
from cuda_emu import LAUNCHED, settings
from cupy_standin import swap

from localkv import kv_format
from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.generation import Generation
from localkv.kv.evict import EvictConfig
from localkv.sampling import SamplingParams
from localkv.scheduler import Scheduler
from localkv.sequence import Sequence

pytestmark = pytest.mark.model
TEXT = (Path(__file__).parents[1] / "data" / "apache-2.0.txt").read_text()
GREEDY_PROMPTS = ["What is 2 + 2?", "Explain what a CPU is in one sentence."]
N_GREEDY = 32


@pytest.fixture(scope="module")
def device():
    """(cupy, emulated); the emulator without guard pages (every buffer copied per launch would
    dominate the run time: tests/backends/test_cuda_emu.py checks the kernels' bounds with them)."""
    with swap.device() as d, settings(guard=False):
        yield d


def _config(path, **kw) -> EngineConfig:
    return EngineConfig(model=path, kv_mem=kw.pop("kv_mem", "16MiB"), **{"disk_cache": False, **kw})


@pytest.fixture(scope="module")
def gpu(device, real_model_path):
    return Engine(_config(real_model_path, device="cuda", prefix_cache=False))


@pytest.fixture(scope="module")
def cpu(real_model_path):
    return Engine(_config(real_model_path, device="cpu", prefix_cache=False, kv_dtype="f32"))


def _chat(engine, prompt: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.render_chat([{"role": "user", "content": prompt}]))


def _greedy(engine, ids, n=N_GREEDY, branches=1):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return Generation(engine, ids, params, n=branches).run()


def _together(engine, prompts_ids, n=N_GREEDY) -> list[list[int]]:
    """Greedy runs of several prompts through one scheduler: one forward pass for all of them a
    step (continuous batching; on CUDA, one paged_decode launch per layer for every sequence)."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    gens = [Generation(engine, ids, params, queued=True) for ids in prompts_ids]
    sched = Scheduler(engine, max_seqs=len(gens))
    for g in gens:
        sched.add(g)
    while not all(g.done for g in gens):
        sched.step()
    return [g.result.tokens for g in gens]


KERNELS = (
    *("paged_prefill_hd64", "paged_decode_hd64", "write_kv_f16", "rmsnorm_f16", "rope_pairs_f16", "silu_mul_f16"),
    *("quant_matvec_q4_1", "dequant_f16_q4_1", "quant_matvec_q8_0", "dequant_f16_q8_0"),
)


@pytest.fixture(scope="module")
def greedy_runs(gpu, cpu):
    """CUDA tokens of GREEDY_PROMPTS (run together), the CPU's (each on its own), and the
    kernels the CUDA run launched."""
    before = {k: LAUNCHED[k] for k in KERNELS}
    got = _together(gpu, [_chat(gpu, p) for p in GREEDY_PROMPTS])
    launched = {k: LAUNCHED[k] - v for k, v in before.items()}
    ref = [_greedy(cpu, _chat(cpu, p)).tokens for p in GREEDY_PROMPTS]
    return got, ref, launched


def test_the_engine_runs_the_cuda_backend(device, gpu):
    from localkv.backends.cuda import CudaBackend
    from localkv.backends.cuda_quant import DeviceQ

    assert isinstance(gpu.backend, CudaBackend) and gpu.pool.k.dtype == np.float16
    assert isinstance(gpu.model.w["0.wqkv"], DeviceQ) and gpu.model.w["0.wqkv"].qtype == "Q4_1"
    assert isinstance(gpu.model.w["tok_embd"], DeviceQ) and gpu.model.w["tok_embd"].qtype == "Q8_0"
    assert gpu.model.cfg.rope_style == "normal"  # GGUF's Q/K row order, kept: pairwise RoPE


def test_greedy_text_matches_the_cpu_backend(device, cpu, greedy_runs):
    got, ref, launched = greedy_runs
    for prompt, g, r in zip(GREEDY_PROMPTS, got, ref):
        assert len(g) == N_GREEDY
        parted = next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), None)
        if parted is not None:  # only where the CPU's own top two tokens nearly tie
            row = cpu.score(_chat(cpu, prompt) + r[:parted])[-1]
            gap = float(row[r[parted]] - row[g[parted]])
            assert gap < 0.35, f"{prompt!r}: CUDA and CPU greedy text part at token {parted} ({gap:.2f} apart)"
    if device[1]:  # every forward ran the kernels, none a fallback: 30 layers; one prefill, 31 decode steps
        n, layers, steps = len(GREEDY_PROMPTS), 30, N_GREEDY - 1
        assert launched["paged_prefill_hd64"] == n * layers  # a launch per prompt
        assert launched["paged_decode_hd64"] == layers * steps  # one launch for both sequences
        assert launched["dequant_f16_q4_1"] == layers * 4  # prefill: wqkv, wo, gate_up, down as fp16 tiles
        assert launched["quant_matvec_q4_1"] == layers * 4 * steps  # decode: the matvec kernel
        assert launched["quant_matvec_q8_0"] == N_GREEDY  # the tied output matrix: logits rows
        assert launched["dequant_f16_q8_0"] == N_GREEDY  # the embedding rows
        for k in ("write_kv_f16", "rope_pairs_f16", "silu_mul_f16"):
            assert launched[k] == layers * N_GREEDY
        assert launched["rmsnorm_f16"] == (2 * layers + 1) * N_GREEDY


def _agree(got, ref, tie: float = 0.35, top1: float = 0.9, tv: float = 0.08):
    """Rows of logits that say the same: the same top-1 token in at least `top1` of them, and
    where not, a near-tie in ref (its gap between the two tokens under `tie`); the softmaxes'
    mean total variation distance under `tv`. (Raw logits are a poor measure here: fp16 moves a
    whole row by up to about 1.5, and this model moves rows by up to 1 between two fp32 runs
    that only chunk a prompt differently.)"""
    g, r = got.argmax(-1), ref.argmax(-1)
    assert float((g == r).mean()) >= top1, f"top-1 agreement {(g == r).mean():.3f}"
    rows = np.flatnonzero(g != r)
    gaps = ref[rows, r[rows]] - ref[rows, g[rows]]
    assert (gaps < tie).all(), f"rows {rows[gaps >= tie]} part where ref's top two are {gaps[gaps >= tie]} apart"

    def softmax(a):
        e = np.exp(a - a.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    dist = 0.5 * np.abs(softmax(got.astype(np.float64)) - softmax(ref.astype(np.float64))).sum(-1)
    assert float(dist.mean()) < tv, f"mean total variation distance {dist.mean():.3f}"


def test_teacher_forced_prefill_logits_match_the_cpu(device, gpu, cpu):
    """One prefill of 48 tokens of English (fp16 tiles + cuBLAS; the CPU: fp32 tiles + BLAS)."""
    ids = gpu.tokenizer.encode(TEXT)[:48]
    _agree(gpu.score(ids), cpu.score(ids))


def test_teacher_forced_decode_logits_match_the_cpu(device, gpu, cpu):
    """8 decode steps (the matvec kernels, paged_decode) after a prefill, one token each, against
    the CPU's exact (prefill) logits of the same text."""
    ids = gpu.tokenizer.encode(TEXT)[:24]
    ref = cpu.score(ids)[15:]
    got, seq = _forced(gpu, ids[:16], ids[16:])
    gpu.free(seq)
    _agree(got, ref)


@pytest.mark.parametrize("kv_dtype", ["q8_0", "q8_0:q4_0"])
def test_quantized_kv_on_the_cuda_backend(device, real_model_path, kv_dtype):
    """A q8_0 (or q8_0:q4_0) pool on the GPU: rows quantized as they are written (write_rows_*),
    prefill and decode reading them as stored, the teacher-forced logits in agreement with the
    CPU engine's on the same formats (as f16's are: test_teacher_forced_decode_logits_match_the_cpu)."""
    gpu, cpu = (
        Engine(_config(real_model_path, device=d, prefix_cache=False, kv_dtype=kv_dtype)) for d in ("cuda", "cpu")
    )
    assert gpu.kv_dtype == kv_dtype and (gpu.pool.k.dtype, gpu.pool.v.dtype) == (cpu.pool.k.dtype, cpu.pool.v.dtype)
    assert gpu.kv_bytes_per_token == cpu.kv_bytes_per_token
    ids = gpu.tokenizer.encode(TEXT)[:24]
    before = LAUNCHED.copy()
    got, seq = _forced(gpu, ids[:16], ids[16:])
    gpu.free(seq)
    if device[1]:
        kinds = {f"write_rows_{f.name}_f16" for f in gpu.kv_formats} | {"paged_prefill_hd64", "paged_decode_hd64"}
        assert all(LAUNCHED[k] > before[k] for k in kinds) and LAUNCHED["write_kv_f16"] == before["write_kv_f16"]
    _agree(got, cpu.score(ids)[15:])


def test_forked_branches_decode_together(device, gpu, greedy_runs):
    """Three greedy branches of one prompt: they share its blocks (the partial last block is
    copied on write), decode in one batch, and each gives the single sequence's tokens."""
    r = _greedy(gpu, _chat(gpu, GREEDY_PROMPTS[0]), n=6, branches=3)
    assert [b.tokens for b in r.branches] == [greedy_runs[0][0][:6]] * 3
    assert r.cow_copies >= 2 and r.peak_blocks < r.unshared_blocks


def test_prefix_cache_on_disk_is_fp16_and_only_for_the_gpu(device, real_model_path):
    """A prompt's full blocks go to the disk tier in the pool's dtype (fp16); a new CUDA engine
    loads them instead of computing them, with the same result; an engine of an fp32 pool never
    reads them."""
    ids = _chat_ids(real_model_path)
    first = Engine(_config(real_model_path, device="cuda", disk_cache=True))
    assert first.disk is not None and first.disk.formats == (kv_format.F16, kv_format.F16)
    r1 = _greedy(first, ids, n=3)
    assert r1.cached_tokens == 0
    second = Engine(_config(real_model_path, device="cuda", disk_cache=True))
    r2 = _greedy(second, ids, n=3)
    full = len(ids) // second.block_size * second.block_size
    assert r2.cached_tokens == full and r2.tokens == r1.tokens
    third = Engine(_config(real_model_path, device="cpu", disk_cache=True, kv_dtype="f32"))
    assert _greedy(third, ids, n=1).cached_tokens == 0


@pytest.mark.parametrize("kv_dtype", ["q8_0", "q8_0:q4_0"])
def test_prefix_cache_on_disk_holds_a_quantized_pools_bytes(device, real_model_path, kv_dtype):
    """A quantized pool's full blocks go to the disk tier as its bytes (entries in its K and V
    formats); a new CUDA engine of those formats loads them, with the same result, an f16 one
    never reads them."""
    ids = _chat_ids(real_model_path)
    first = Engine(_config(real_model_path, device="cuda", disk_cache=True, kv_dtype=kv_dtype))
    assert first.disk is not None and first.disk.formats == kv_format.parse(kv_dtype)
    r1 = _greedy(first, ids, n=3)
    second = Engine(_config(real_model_path, device="cuda", disk_cache=True, kv_dtype=kv_dtype))
    r2 = _greedy(second, ids, n=3)
    full = len(ids) // second.block_size * second.block_size
    assert r1.cached_tokens == 0 and r2.cached_tokens == full and r2.tokens == r1.tokens
    f16 = Engine(_config(real_model_path, device="cuda", disk_cache=True))
    assert _greedy(f16, ids, n=1).cached_tokens == 0


def _chat_ids(path) -> list[int]:
    from localkv.model.loader import load_model

    tok = load_model(path).tokenizer
    return tok.encode(tok.render_chat([{"role": "user", "content": GREEDY_PROMPTS[1]}]))


def _forced(engine, ids, forced):
    """Logits of a prefill of ids, then of one decode step per forced token; and the sequence."""
    seq = Sequence(list(ids))
    out = [engine.prefill(seq)]
    for t in forced:
        seq.tokens.append(t)
        out.append(engine.decode([seq])[0])
    return np.array(out), seq


def _chunked(engine, ids, forced):
    """Logits of every prompt token (chunks of the policy's chunk limit, logits of all rows, as
    Engine.score), then of one decode step per forced token; and the sequence."""
    seq, out = Sequence(list(ids)), []
    while seq.pending:
        out.append(engine.forward([seq], engine.config.prefill_chunk, all_logits=True))
    for t in forced:
        seq.tokens.append(t)
        out.append(engine.decode([seq]))
    return np.concatenate(out), seq


@pytest.mark.parametrize("policy", ["sliding", "h2o", "offload"])
def test_eviction_policies(device, real_model_path, policy):
    """64 prompt tokens under a 48-token KV budget (blocks of 8, 16 recent tokens: chunks of 16
    rows, the exact matmul path on both backends), then 4 decode steps: the CUDA engine evicts,
    recalls blocks exactly as the CPU engine does, keeps nearly the same heavy hitters, and its logits agree
    (_agree; the decode steps' looser: the CPU rounds their activations to int8)."""
    evict = EvictConfig(policy=policy, budget=48, recent=16)
    gpu, cpu = (Engine(_config(real_model_path, device=d, prefix_cache=False, block_size=8, evict=evict,
                               kv_dtype="f16")) for d in ("cuda", "cpu"))  # fmt: skip
    ids = gpu.tokenizer.encode(TEXT)[:68]
    (got, sg), (ref, sc) = (_chunked(e, ids[:64], ids[64:]) for e in (gpu, cpu))
    gs, cs = gpu.stats, cpu.stats
    assert gs.evictions + gs.offloads > 0
    assert (gs.evictions, gs.offloads, gs.recalls) == (cs.evictions, cs.offloads, cs.recalls)
    assert len(sg.block_table) == len(sc.block_table)
    if policy == "h2o":
        hg, hc = gpu.policy.seqs[sg.id].heavy, cpu.policy.seqs[sc.id].heavy
        assert hg.n == hc.n > 0  # the same tokens, but for near-ties in fp16 vs fp32 attention mass
        same = [
            len(set(a) & set(b))
            for a, b in zip(hg.pos[:, :, : hg.n].reshape(-1, hg.n), hc.pos[:, :, : hc.n].reshape(-1, hc.n))
        ]
        assert sum(same) / (len(same) * hg.n) >= 0.85
    _agree(got[:64], ref[:64])
    _agree(got[64:], ref[64:], tie=1.0, top1=0.5, tv=0.15)  # the CPU's decode steps: int8 activations
