"""Options shared by the commands that build an engine or sample replies, declared once.

`@engine_options()` adds the engine's flags to a command and hands it one `engine:
EngineConfig`; `@sampling_options()` adds the sampling flags and hands it `sampling:
SamplingParams`. Defaults come from those two dataclasses, so `--help` and the library agree.
"""

import functools
import inspect
from dataclasses import fields
from typing import Annotated, Any

import typer

from localkv.config import EngineConfig
from localkv.kv.evict import EvictConfig
from localkv.sampling import SamplingParams

_ENGINE, _EVICT, _SAMPLING = EngineConfig(), EvictConfig(), SamplingParams()
_EVICT_HELP = (
    "When the budget is full: none (stop), sliding (attention sinks + recent window), h2o (half the window, "
    "+ each layer-head's heaviest tokens), offload (move blocks to host memory and recall them when the "
    "query needs them)."
)

# name -> (type, default, flags, help): the engine's options, as every command spells them
ENGINE_OPTIONS: dict[str, tuple[Any, Any, tuple[str, ...], str]] = {
    "model": (
        str | None,
        None,
        ("-m", "--model"),
        "Catalog name (see `localkv models`), a .gguf file, or a Hugging Face style directory "
        "(config.json + *.safetensors + tokenizer.json). Default: smollm2-135m.",
    ),
    "device": (str, _ENGINE.device, ("--device",), "auto (CUDA when CuPy sees a GPU, else CPU), cpu or cuda."),
    "threads": (int | None, None, ("--threads",), "CPU threads for matrix math (default: all cores)."),
    "block_size": (int, _ENGINE.block_size, ("--block-size",), "Tokens per KV block."),
    "kv_mem": (str, "1GiB", ("--kv-mem",), "Memory for the KV block pool, e.g. 512MiB or 2GiB."),
    "no_cache": (bool, False, ("--no-cache",), "Disable the prefix cache (memory and disk tiers)."),
    "disk_cache_size": (str, "2GiB", ("--disk-cache-size",), "Size cap of the on-disk prefix cache (LRU)."),
    "kv_budget": (
        int | None,
        None,
        ("--kv-budget",),
        "Most tokens of KV one sequence may hold; past it --evict decides.",
    ),
    "evict": (str, _EVICT.policy, ("--evict",), _EVICT_HELP),
    "sinks": (int, _EVICT.sinks, ("--sinks",), "Attention-sink tokens always kept (rounded up to whole blocks)."),
    "offload_dir": (str | None, None, ("--offload-dir",), "Spill offloaded blocks to a file here instead of RAM."),
}

SAMPLING_OPTIONS: dict[str, tuple[Any, Any, tuple[str, ...], str]] = {
    "max_tokens": (int, _SAMPLING.max_tokens, ("-n", "--max-tokens"), "Most tokens to generate (per reply)."),
    "temperature": (float, _SAMPLING.temperature, ("-t", "--temperature"), "Sampling temperature; 0 = greedy."),
    "top_k": (int, _SAMPLING.top_k, ("--top-k",), "Sample from the k most likely tokens; 0 = all."),
    "top_p": (float, _SAMPLING.top_p, ("--top-p",), "Nucleus sampling threshold, in (0, 1]."),
    "seed": (
        int | None,
        None,
        ("--seed",),
        "Random seed: the same seed gives the same text (branch i of a fork uses seed + i).",
    ),
    "ignore_eos": (bool, False, ("--ignore-eos",), "Keep generating past end-of-sequence tokens."),
}


def engine_config(values: dict) -> EngineConfig:
    """An EngineConfig from the engine options' values (missing ones take their defaults),
    validated before any model loads."""
    v = {name: spec[1] for name, spec in ENGINE_OPTIONS.items()} | values
    evict = EvictConfig(policy=v["evict"], budget=v["kv_budget"], sinks=v["sinks"])
    names = {f.name for f in fields(EngineConfig)} - {"evict", "prefix_cache"}
    kept = {k: v[k] for k in names if k in v}
    return EngineConfig(**kept, evict=evict, prefix_cache=not v["no_cache"]).validate()


def sampling_params(values: dict) -> SamplingParams:
    return SamplingParams(**values).validate()


def _with_options(specs: dict, names, flags: dict, defaults: dict, target: str, build):
    """A decorator adding the options `names` of `specs` to a Typer command, which receives the
    built object as its keyword `target`."""
    chosen = list(names) or list(specs)

    def decorate(fn):
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.name != target]
        for name in chosen:
            typ, default, decls, help_text = specs[name]
            default = defaults.get(name, default)
            opt = typer.Option(*flags.get(name, decls), help=help_text)
            params.append(
                inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[typ, opt])
            )

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            values = {name: kwargs.pop(name) for name in chosen}
            return fn(*args, **kwargs, **{target: build(values)})

        wrapper.__signature__ = sig.replace(parameters=params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return decorate


def engine_options(*names: str, flags: dict | None = None, defaults: dict | None = None):
    """Add the engine options (all, or `names`) to a command, passed to it as `engine`."""
    return _with_options(ENGINE_OPTIONS, names, flags or {}, defaults or {}, "engine", engine_config)


def sampling_options(*names: str, flags: dict | None = None, defaults: dict | None = None):
    """Add the sampling options (all, or `names`) to a command, passed to it as `sampling`."""
    return _with_options(SAMPLING_OPTIONS, names, flags or {}, defaults or {}, "sampling", sampling_params)
