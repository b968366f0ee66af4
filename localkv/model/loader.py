"""Load a model: a GGUF file (model/gguf_loader.py) or a Hugging Face directory (model/hf_dir.py)
-> ModelConfig, the weights in place (model/weights.py: QTensors over the mapped file) and the
tokenizer. Nothing is converted or written: a first start costs what every start does.
"""

import time
from dataclasses import dataclass
from pathlib import Path

from localkv.model.config import ModelConfig
from localkv.model.gguf_loader import load_gguf
from localkv.model.hf_dir import load_hf_dir


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    weights: dict
    tokenizer: object
    path: Path
    load_s: float
    cache_hit: bool = True  # no weight is converted at load any more (callers once reported a first-start cost)


def load_model(path: Path, progress: bool = False) -> LoadedModel:
    """progress is accepted for the callers' sake: loading has no slow phase left to report."""
    t0 = time.perf_counter()
    path = Path(path)
    config, weights, tok = load_hf_dir(path) if path.is_dir() else load_gguf(path)
    return LoadedModel(config, weights, tok, path, time.perf_counter() - t0)
