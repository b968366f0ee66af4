"""Packages are found, not listed: localkv/ as it is, and three top-level folders installed inside
it, which `[tool.setuptools.packages.find]` cannot rename. `tui/` becomes `localkv.tui`,
`models/` (the catalog's TOML) `localkv.catalog`, and `cuda/` (CUDA C, read as files)
`localkv.cuda`: a top-level `cuda` module would shadow NVIDIA's, which CuPy imports."""

from setuptools import find_packages, setup

INSIDE = {"localkv.tui": "tui", "localkv.catalog": "models", "localkv.cuda": "cuda"}

packages = find_packages(include=["localkv", "localkv.*"])
for name, folder in INSIDE.items():
    packages += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]

setup(packages=packages, package_dir={"localkv": "localkv", **INSIDE})
