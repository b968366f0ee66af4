"""The stale-cache guard (build.drop_stale_cache). numba keys a cached kernel on its own file,
not on the SIMD intrinsics, block decoders and helpers it inlined from the other files of
backends/cpu/, so an edit to any of those must drop the cached kernels, and an unchanged tree
must keep them. Run on a scratch copy of the tree, never the real one."""

import shutil

import pytest

from localkv.backends.cpu import build


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "cpu"
    shutil.copytree(build.ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    build.drop_stale_cache(root)  # the first look stamps the sources
    return root


def cache_kernels(root):
    """Index and code files where numba caches the kernels of each kernel module."""
    for module in ("kernels/attention", "kernels/matmul_few", "kernels/superblock"):
        folder = (root / module).parent / "__pycache__"
        folder.mkdir(exist_ok=True)
        stem = (root / module).name
        (folder / f"{stem}.kernel-1.py312.nbi").write_bytes(b"index")
        (folder / f"{stem}.kernel-1.py312.1.nbc").write_bytes(b"machine code")


def cached(root) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("__pycache__/*.nb[ic]"))


def test_an_edit_to_the_formats_constants_drops_every_cached_kernel(tree, tmp_path):
    """The kernels freeze kv_format's block sizes and encoder divisors in as constants."""
    constants = tmp_path / "kv_format.py"
    shutil.copy(build.kv_format.__file__, constants)
    build.drop_stale_cache(tree, constants)
    cache_kernels(tree)
    assert not build.drop_stale_cache(tree, constants)
    constants.write_text(constants.read_text().replace("127", "126", 1))
    assert build.drop_stale_cache(tree, constants) and cached(tree) == []


def test_an_unchanged_tree_keeps_the_cache(tree):
    cache_kernels(tree)
    assert not build.drop_stale_cache(tree)
    assert len(cached(tree)) == 6


@pytest.mark.parametrize(
    "helper", ["simd/f32x8.py", "simd/u8x32.py", "simd/wide.py", "formats/blocks.py", "kernels/__init__.py", "build.py"]
)
def test_an_edit_to_any_source_drops_every_cached_kernel(tree, helper):
    """A helper the attention kernels inline (f32x8) and those of the weight kernels, in every
    folder of the tree: the kernels' own files are unchanged, so numba's cache alone would
    still take their machine code."""
    cache_kernels(tree)
    path = tree / helper
    path.write_text(path.read_text() + "\n# edited\n")
    assert build.drop_stale_cache(tree)
    assert cached(tree) == []
    cache_kernels(tree)  # rebuilt from the edited sources: kept from now on
    assert not build.drop_stale_cache(tree) and cached(tree)


def test_a_new_module_drops_the_cache(tree):
    cache_kernels(tree)
    (tree / "simd" / "extra.py").write_text("X = 1\n")
    assert build.drop_stale_cache(tree)
    assert cached(tree) == []


def test_the_guard_covers_the_tree_numba_compiles_from():
    """Every kernel module and what it inlines lies under the guarded root."""
    assert build.ROOT.name == "cpu"
    for module in ("kernels/attention.py", "kernels/decode_rows.py", "simd/f32x8.py", "formats/blocks.py"):
        assert (build.ROOT / module).is_file()
