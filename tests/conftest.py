import importlib.util

import pytest


def pytest_collection_modifyitems(config, items):
    has_peer = importlib.util.find_spec("llama_cpp") is not None
    for item in items:
        if "peer" in item.keywords and not has_peer:
            item.add_marker(pytest.mark.skip(reason="llama-cpp-python not installed (pip install -e '.[peer]')"))


@pytest.fixture(scope="session")
def real_model_path():
    """The real SmolLM2-135M GGUF, pulled into LOCALKV_HOME on first use."""
    from localkv.pull import ensure_model

    return ensure_model("smollm2-135m", progress=False)
