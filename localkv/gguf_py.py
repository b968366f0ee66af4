"""What localkv takes from gguf-py (llama.cpp's Python package): the table of ggml tensor types
and the reference dequantizer.

Both are loaded from gguf-py's folder without running its package __init__, which imports the
whole library (reader, writer, vocab, metadata, and yaml with it): a twentieth of an engine start
for one table and one function. Its constants.py and quants.py import only each other, lazy.py,
numpy and the standard library. They load as modules of a package of their own
(`localkv._gguf`), so a later `import gguf` gets its own copies as usual; localkv passes type
names between the two, never their enum values.
"""

import importlib
import importlib.util
import sys
import types

_PACKAGE = "localkv._gguf"  # gguf-py's folder, as a package whose __init__ never runs


def _module(name: str):
    full = f"{_PACKAGE}.{name}"
    if full in sys.modules:
        return sys.modules[full]
    if _PACKAGE not in sys.modules:
        spec = importlib.util.find_spec("gguf")  # finds the package without running it
        if spec is None or not spec.submodule_search_locations:
            return importlib.import_module(f"gguf.{name}")  # an unusual install: the plain import
        package = types.ModuleType(_PACKAGE)
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules[_PACKAGE] = package
    return importlib.import_module(full)


def _table() -> dict[int, tuple[str, int, int]]:
    c = _module("constants")
    return {int(t): (t.name, *c.GGML_QUANT_SIZES[t]) for t in c.GGMLQuantizationType if t in c.GGML_QUANT_SIZES}


TYPES = _table()  # ggml type id -> (name, elements per block, bytes per block)
BY_NAME = {name: (tid, block, size) for tid, (name, block, size) in TYPES.items()}


def block_size(name: str) -> tuple[int, int]:
    """(elements, bytes) of one block of the named type; KeyError for a name ggml lacks."""
    _, block, size = BY_NAME[name]
    return block, size


def dequantize(blocks, name: str):
    """gguf-py's float32 values of rows of blocks (uint8 [rows, bytes]) of the named type."""
    return _module("quants").dequantize(blocks, _module("constants").GGMLQuantizationType[name])
