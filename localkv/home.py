"""Where localkv keeps its files: LOCALKV_HOME (default ~/.cache/localkv)."""

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("LOCALKV_HOME") or Path.home() / ".cache" / "localkv")


def models_dir() -> Path:
    return home() / "models"
