"""What tests need from outside the package: the repository's scripts/ as modules, and what a
test does when a resource it needs (a registry, a download) cannot be had."""

import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def script(name: str) -> ModuleType:
    """scripts/NAME.py, imported once as the module NAME (in sys.modules before it runs, which
    its dataclasses need)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(why: str):
    """A resource the tests need cannot be had. In CI (CI set) that is a failure: the registries
    are reachable there, and a skip would hide every test that needs it. Elsewhere (offline) the
    tests skip, with a warning in pytest's summary so the skips are not silent."""
    if in_ci():
        pytest.fail(f"{why} (CI is set: this must be available in CI)", pytrace=False)
    warnings.warn(f"{why}: the tests that need it are SKIPPED (with CI=true they fail)", stacklevel=2)
    pytest.skip(f"offline: {why}")
