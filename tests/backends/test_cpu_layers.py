"""The CPU backend is a straight stack: simd -> formats -> kernels -> quant -> the rest, no
module importing one of a layer above its own (imports inside functions included). A module
beside the packages that imports nothing of the backend (loaded: the record of what loaded)
sits below them all."""

import ast
from pathlib import Path

import localkv.backends.cpu as cpu

ROOT = Path(cpu.__file__).parent
LAYERS = ["simd", "formats", "kernels", "quant"]  # bottom up; the modules beside them are above all
PREFIX = "localkv.backends.cpu."


def layer(name: str) -> int:
    """A module's layer from its dotted name under the backend (beside the packages: the top,
    or the bottom when it imports nothing of the backend)."""
    head = name.split(".")[0]
    if head in LAYERS:
        return LAYERS.index(head)
    leaf = (ROOT / f"{head}.py").is_file() and not imports(ROOT / f"{head}.py")
    return -1 if leaf else len(LAYERS)


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names if node.module == "localkv.backends.cpu")
    return {n[len(PREFIX) :] for n in names if n.startswith(PREFIX)}


def test_no_module_imports_a_layer_above_its_own():
    wrong = []
    for path in ROOT.rglob("*.py"):
        mine = layer(path.relative_to(ROOT).with_suffix("").as_posix().replace("/", "."))
        wrong += [f"{path.relative_to(ROOT)} -> {n}" for n in imports(path) if layer(n) > mine]
    assert not wrong, wrong


def test_the_check_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from localkv.backends.cpu.quant import tensor\n")
    assert layer("formats.blocks") < max(layer(n) for n in imports(bad))
