"""Options shared by the commands that build an engine or sample replies, declared once.

`@engine_options()` adds the engine's flags to a command and hands it one `engine:
EngineConfig`; `@sampling_options()` adds the sampling flags and hands it `sampling: Sampling`,
the flags given, which resolve() turns into SamplingParams once the model is known (a model's
catalog entry may set its own defaults: `--help` says "model default" for those). Defaults come
from those dataclasses, so `--help` and the library agree, except --spec: the commands
speculate by prompt lookup unless told (spec.control.COMMANDS_DEFAULT), the library does not.
"""

import functools
import inspect
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any

import typer

from localkv import kv_format
from localkv.config import EngineConfig
from localkv.errors import LocalkvError
from localkv.hub.catalog import sampling_for
from localkv.kv.evict import EvictConfig
from localkv.sampling import MAX_LOGPROBS, Constraint, SamplingParams
from localkv.spec import control as speculation

_ENGINE, _EVICT, _SAMPLING = EngineConfig(), EvictConfig(), SamplingParams()
_SIZES = {f.name: f.default for f in fields(EngineConfig)}  # sizes as written (EngineConfig keeps bytes)
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
        "Catalog name (see `localkv models`), hf:OWNER/REPO/FILE.gguf (pulled from the hub on first use), "
        "a .gguf file, or a Hugging Face style directory (config.json + *.safetensors + tokenizer.json). "
        "Default: smollm2-135m.",
    ),
    "device": (str, _ENGINE.device, ("--device",), "auto (CUDA when CuPy sees a GPU, else CPU), cpu or cuda."),
    "threads": (int | None, None, ("--threads",), "CPU threads for matrix math (default: all cores)."),
    "block_size": (int, _ENGINE.block_size, ("--block-size",), "Tokens per KV block."),
    "kv_mem": (str, _SIZES["kv_mem"], ("--kv-mem",), "Memory for the KV block pool, e.g. 512MiB or 2GiB."),
    "no_cache": (bool, False, ("--no-cache",), "Disable the prefix cache (memory and disk tiers)."),
    "disk_cache_size": (
        str,
        _SIZES["disk_cache_size"],
        ("--disk-cache-size",),
        "Size cap of the on-disk prefix cache (LRU).",
    ),
    "kv_budget": (
        int | None,
        None,
        ("--kv-budget",),
        "Most tokens of KV one sequence may hold; past it --evict decides.",
    ),
    "evict": (str, _EVICT.policy, ("--evict",), _EVICT_HELP),
    "sinks": (int, _EVICT.sinks, ("--sinks",), "Attention-sink tokens always kept (rounded up to whole blocks)."),
    "offload_dir": (str | None, None, ("--offload-dir",), "Spill offloaded blocks to a file here instead of RAM."),
    "ctx": (
        int | None,
        None,
        ("--ctx",),
        "Most tokens one sequence may hold, prompt and reply (default: the model's context); the KV pool must hold it.",
    ),
    "kv_dtype": (
        str,
        _ENGINE.kv_dtype,
        ("--kv-dtype",),
        "How K/V rows are stored: f32, f16, q8_0, q4_0 (GGUF's blocks), K:V apart (q8_0:q4_0), or auto "
        "(the backend's default: q8_0:q4_0 on the CPU where the kernels run and a head splits into "
        "blocks of 32, else f16; f16 on CUDA, which takes f16, q8_0 and q4_0).",
    ),
    "cache_type_k": (
        str | None,
        None,
        ("-ctk", "--cache-type-k"),
        "K's format alone (llama.cpp's -ctk): the K half of --kv-dtype (V keeps its own).",
    ),
    "cache_type_v": (
        str | None,
        None,
        ("-ctv", "--cache-type-v"),
        "V's format alone (llama.cpp's -ctv): the V half of --kv-dtype (K keeps its own).",
    ),
    "kv_rotate": (
        bool,
        _ENGINE.kv_rotate,
        ("--kv-rotate/--no-kv-rotate",),
        "Store a quantized K or V rotated (a Hadamard transform of each head, as llama.cpp does): "
        "q4_0 K/V loses far less. Float K/V are never rotated.",
    ),
    "spec": (
        str | None,
        None,
        ("--spec",),
        f"Speculative decoding: ngram (draft the next tokens from the context's own earlier text, as long as "
        f"a draft pays), draft (a small model of the same vocabulary drafts them, --draft-model) or off; each "
        f"draft is verified in one pass and greedy text is the same. Default: {speculation.COMMANDS_DEFAULT}, "
        f"draft with --draft-model. Off under --evict sliding, h2o or offload.",
    ),
    "draft_model": (
        str | None,
        None,
        ("--draft-model",),
        "--spec draft: the draft model, named as for -m (catalog name, .gguf path, hf:, ollama:); it must "
        "have the model's vocabulary. Its K/V share --kv-mem with the model's.",
    ),
    "spec_max": (
        int,
        _ENGINE.spec_max,
        ("--spec-max",),
        "Most tokens drafted per verify pass; 0: 15 for --spec ngram on greedy text, else 8.",
    ),
    "spec_ngram_max": (
        int,
        _ENGINE.spec_ngram_max,
        ("--spec-ngram-max",),
        "Longest n-gram of the context's end looked up for a draft.",
    ),
    "spec_ngram_min": (
        int,
        _ENGINE.spec_ngram_min,
        ("--spec-ngram-min",),
        "Shortest n-gram looked up (1 drafts after any repeated token).",
    ),
}


def _model_default(text: str, name: str) -> str:
    return f"{text} [default: model default (see `localkv show`), else {getattr(_SAMPLING, name)}]"


SAMPLING_OPTIONS: dict[str, tuple[Any, Any, tuple[str, ...], str]] = {
    "max_tokens": (int, _SAMPLING.max_tokens, ("-n", "--max-tokens"), "Most tokens to generate (per reply)."),
    # None: not given, so the model's catalog default (MODEL_SAMPLING) or SamplingParams' applies
    "temperature": (
        float | None,
        None,
        ("-t", "--temperature"),
        _model_default("Sampling temperature; 0 = greedy.", "temperature"),
    ),
    "top_k": (
        int | None,
        None,
        ("--top-k",),
        _model_default("Sample from the k most likely tokens; 0 = all.", "top_k"),
    ),
    "top_p": (float | None, None, ("--top-p",), _model_default("Nucleus sampling threshold, in (0, 1].", "top_p")),
    "min_p": (
        float | None,
        None,
        ("--min-p",),
        _model_default("Drop tokens less likely than MIN_P x the most likely one; 0 = off.", "min_p"),
    ),
    "repeat_penalty": (
        float | None,
        None,
        ("--repeat-penalty",),
        _model_default(
            "Penalize the last --repeat-last-n tokens (llama.cpp's): 1 = off, 1.1 is mild.", "repeat_penalty"
        ),
    ),
    "repeat_last_n": (
        int | None,
        None,
        ("--repeat-last-n",),
        _model_default("Recent tokens (prompt included) the penalties look at; -1 = all, 0 = off.", "repeat_last_n"),
    ),
    "presence_penalty": (
        float | None,
        None,
        ("--presence-penalty",),
        _model_default("Subtracted once from the logit of each recent token.", "presence_penalty"),
    ),
    "frequency_penalty": (
        float | None,
        None,
        ("--frequency-penalty",),
        _model_default("Subtracted from a recent token's logit per occurrence.", "frequency_penalty"),
    ),
    "dry_multiplier": (
        float | None,
        None,
        ("--dry-multiplier",),
        _model_default(
            "DRY: penalize tokens that would continue a repeated sequence; 0 = off, 0.8 is usual.", "dry_multiplier"
        ),
    ),
    "dry_base": (
        float | None,
        None,
        ("--dry-base",),
        _model_default("DRY: the penalty grows by this factor per repeated token (>= 1).", "dry_base"),
    ),
    "dry_allowed_length": (
        int | None,
        None,
        ("--dry-allowed-length",),
        _model_default("DRY: repeats up to this many tokens go unpenalized.", "dry_allowed_length"),
    ),
    "dry_penalty_last_n": (
        int | None,
        None,
        ("--dry-penalty-last-n",),
        _model_default("Recent tokens (prompt included) DRY looks at; -1 = all, 0 = off.", "dry_penalty_last_n"),
    ),
    "seed": (
        int | None,
        None,
        ("--seed",),
        "Random seed: the same seed gives the same text (branch i of a fork uses seed + i).",
    ),
    "stop": (
        list[str] | None,
        None,
        ("--stop",),
        "End the reply at this text (repeatable); the stop text is not printed, its K/V is freed.",
    ),
    "ignore_eos": (bool, False, ("--ignore-eos",), "Keep generating past end-of-sequence tokens."),
    "think": (
        bool | None,
        None,
        ("--think/--no-think",),
        "A thinking model (Qwen3, DeepSeek-R1 distills: see `localkv show`) thinks before it answers, or "
        "answers at once (its template's no-thinking form). [default: think]",
    ),
    "reasoning_budget": (
        int | None,
        None,
        ("--reasoning-budget",),
        "Most tokens a thinking model thinks: then its closing tag is forced and it answers; 0 = --no-think. "
        "[default: -1, no limit]",
    ),
}

# what one reply's output must match or report: for commands that print replies (run, fork)
OUTPUT_OPTIONS: dict[str, tuple[Any, Any, tuple[str, ...], str]] = {
    "logprobs": (
        int | None,
        None,
        ("--logprobs",),
        f"With --json: each token's log-probability and its top N alternatives (0..{MAX_LOGPROBS}).",
    ),
    "format": (str | None, None, ("--format",), "json: the reply is a JSON object (constrained sampling)."),
    "schema": (Path | None, None, ("--schema",), "The reply matches this JSON Schema file (constrained sampling)."),
    "grammar": (Path | None, None, ("--grammar",), "The reply matches this grammar file: Lark or GBNF."),
}


def engine_config(values: dict) -> EngineConfig:
    """An EngineConfig from the engine options' values (missing ones take their defaults),
    validated before any model loads."""
    v = {name: spec[1] for name, spec in ENGINE_OPTIONS.items()} | values
    if v["spec"] is None or (v["draft_model"] and v["spec"] == "off"):  # a draft model given is one asked for
        v["spec"] = "draft" if v["draft_model"] else speculation.COMMANDS_DEFAULT
    evict = EvictConfig(policy=v["evict"], budget=v["kv_budget"], sinks=v["sinks"])
    names = {f.name for f in fields(EngineConfig)} - {"evict", "prefix_cache"}
    kept = {k: v[k] for k in names if k in v}
    if "kv_dtype" in kept:
        kept["kv_dtype"] = kv_dtype(kept["kv_dtype"], v["cache_type_k"], v["cache_type_v"])
    return EngineConfig(**kept, evict=evict, prefix_cache=not v["no_cache"]).validate()


def kv_dtype(choice: str, k: str | None, v: str | None) -> str:
    """--kv-dtype with -ctk / -ctv setting its K and V halves; a half neither names stays
    --kv-dtype's (auto's: llama.cpp's default, f16, when the other half is given)."""
    if k is None and v is None:
        return choice
    pair = ["f16", "f16"] if choice.strip().lower() == "auto" else [f.name for f in kv_format.parse(choice)]
    for i, (flag, given) in enumerate((("-ctk", k), ("-ctv", v))):
        if given is None:
            continue
        if given.strip().lower() not in kv_format.FORMATS:
            raise LocalkvError(f"unknown {flag} {given!r}: use one of {', '.join(kv_format.FORMATS)}")
        pair[i] = given.strip().lower()
    return kv_format.pair_name(*(kv_format.FORMATS[n] for n in pair))


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampling flags as given (None: not given), checked; resolve() adds the model's
    catalog defaults once the model is known."""

    values: dict

    def resolve(self, model: str | Path | None) -> SamplingParams:
        return sampling_for(model, self.values)


def sampling_choice(values: dict) -> Sampling:
    """The sampling options' values, checked before any model loads (a bad schema too)."""
    v = dict(values)
    constraint = _constraint(v.pop("format", None), v.pop("schema", None), v.pop("grammar", None))
    given = {k: x for k, x in v.items() if x is not None} | ({"constraint": constraint} if constraint else {})
    if "stop" in given:
        given["stop"] = tuple(given["stop"])
    SamplingParams(**given).validate()
    if constraint is not None:
        from localkv.grammar import check

        check(constraint)
    return Sampling(given)


def _constraint(fmt: str | None, schema: Path | None, grammar: Path | None) -> Constraint | None:
    chosen = [f for f, x in (("--format", fmt), ("--schema", schema), ("--grammar", grammar)) if x is not None]
    if len(chosen) > 1:
        raise LocalkvError(f"{' and '.join(chosen)} do not go together: pick one way to constrain the reply")
    if fmt is not None:
        if fmt.strip().lower() != "json":
            raise LocalkvError(f"unknown --format {fmt!r}: use json (or --schema FILE for a JSON Schema)")
        return Constraint("json")
    if schema is not None:
        return Constraint("json_schema", _read(schema, "--schema"), str(schema))
    if grammar is not None:
        return Constraint("grammar", _read(grammar, "--grammar"), str(grammar))
    return None


def _read(path: Path, flag: str) -> str:
    try:
        if not path.is_file():
            raise LocalkvError(f"cannot read {flag} {path}: not a file")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise LocalkvError(f"cannot read {flag} {path}: not UTF-8 text") from None
    except OSError as e:
        raise LocalkvError(f"cannot read {flag} {path}: {e.strerror or e}") from None


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
            # an option a Python caller leaves out takes its default, as on the command line
            values = {name: kwargs.pop(name, defaults.get(name, specs[name][1])) for name in chosen}
            return fn(*args, **kwargs, **{target: build(values)})

        wrapper.__signature__ = sig.replace(parameters=params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper

    return decorate


def engine_options(*names: str, flags: dict | None = None, defaults: dict | None = None):
    """Add the engine options (all, or `names`; kv_dtype brings -ctk / -ctv and --kv-rotate) to a command,
    passed to it as `engine`."""
    if "kv_dtype" in names:
        names = (*names, "cache_type_k", "cache_type_v", "kv_rotate")
    return _with_options(ENGINE_OPTIONS, names, flags or {}, defaults or {}, "engine", engine_config)


def sampling_options(*names: str, flags: dict | None = None, defaults: dict | None = None, output: bool = False):
    """Add the sampling options (all, or `names`; with output, also OUTPUT_OPTIONS) to a command,
    passed to it as `sampling`: a Sampling to resolve() once the model is known."""
    specs = SAMPLING_OPTIONS | (OUTPUT_OPTIONS if output else {})
    return _with_options(specs, names, flags or {}, defaults or {}, "sampling", sampling_choice)
