"""The memory guard (hub/fit.py): weights + KV pool + overhead against the memory available,
checked before a model loads; the available-memory reader is replaced to make any machine small."""

import io

import pytest

from localkv.cli import main
from localkv.config import EngineConfig
from localkv.engine import Engine
from localkv.hub import fit
from localkv.hub.fit import OVERHEAD, NotEnoughMemory, available_memory, check_fits, estimate, weights_bytes
from tiny_model import write_gguf, write_hf_dir

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("guard") / "tiny.gguf", ctx=64)


@pytest.fixture
def memory(monkeypatch):
    """Set the machine's available memory: memory(bytes), or memory(None) for a system without one."""
    monkeypatch.delenv(fit.OFF, raising=False)

    def set_available(n):
        monkeypatch.setattr(fit, "available_memory", lambda: n)

    return set_available


def test_meminfo_is_read(tmp_path, monkeypatch):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20971520 kB\nBuffers: 1 kB\n")
    monkeypatch.setattr(fit, "MEMINFO", f)
    assert available_memory() == 20 * GiB
    f.write_text("MemTotal: 1 kB\n")  # an old kernel without MemAvailable
    assert available_memory() is None
    monkeypatch.setattr(fit, "MEMINFO", tmp_path / "absent")
    assert available_memory() is None


def test_estimate_counts_the_file_or_the_safetensors(tiny, tmp_path):
    assert estimate(tiny, 100 * MiB).total == tiny.stat().st_size + 100 * MiB + OVERHEAD
    d = write_hf_dir(tmp_path / "hf")
    (d / "notes.bin").write_bytes(b"x" * 12345)  # not weights
    want = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    assert want > 0 and weights_bytes(d) == want


def test_fits_or_not(tiny, memory):
    size = tiny.stat().st_size
    memory(size + 256 * MiB + OVERHEAD)
    check_fits(tiny, 256 * MiB)  # exactly enough
    with pytest.raises(NotEnoughMemory):
        check_fits(tiny, 256 * MiB + 1)
    check_fits(tiny, 4 * GiB, kv_on_host=False)  # a GPU's KV pool is not host memory


def test_kv_too_big_says_which_kv_mem_fits(tiny, memory):
    memory(tiny.stat().st_size + OVERHEAD + 300 * MiB)
    with pytest.raises(NotEnoughMemory) as e:
        check_fits(tiny, 2 * GiB)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("tiny.gguf needs about 2.") and "KV pool 2.0 GiB" in msg and "runtime" in msg
    assert "is available: lower --kv-mem to 300MiB or less" in msg and "LOCALKV_NO_MEMORY_GUARD=1" in msg


def test_weights_too_big_says_smaller_quant(tiny, memory):
    memory(OVERHEAD)
    with pytest.raises(NotEnoughMemory) as e:
        check_fits(tiny, 64 * MiB)
    assert "use a smaller quant or model (the weights alone need" in str(e.value)


def test_override_and_unknown_memory(tiny, memory, monkeypatch):
    memory(1)
    monkeypatch.setenv(fit.OFF, "1")
    check_fits(tiny, GiB)
    monkeypatch.setenv(fit.OFF, "0")
    with pytest.raises(NotEnoughMemory):
        check_fits(tiny, GiB)
    memory(None)  # no /proc/meminfo: no guard
    check_fits(tiny, GiB)


def test_engine_refuses_before_loading(tiny, memory, monkeypatch):
    import localkv.engine as engine_mod

    def never(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine_mod, "load_model", never)
    memory(GiB)
    with pytest.raises(NotEnoughMemory, match="lower --kv-mem"):
        Engine(EngineConfig(model=str(tiny), kv_mem="1GiB"))


def test_engine_loads_when_it_fits(tiny, memory):
    memory(64 * GiB)
    assert Engine(EngineConfig(model=str(tiny), kv_mem="16MiB")).path == tiny


def test_cli_one_line(tiny, memory, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    memory(GiB)
    assert main(["run", "-m", str(tiny), "hi", "--kv-mem", "2GiB", "--no-save"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: tiny.gguf needs about") and "--kv-mem" in err[0]
