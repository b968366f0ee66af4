"""`localkv cache stats|ls|clear`: look at and empty the on-disk prefix cache
(LOCALKV_HOME/kvcache). The main CLI registers cache_app under the name "cache"."""

import json
import time

import typer

from localkv.kv.disk_store import DiskStore
from localkv.units import format_size

cache_app = typer.Typer(
    help="The on-disk prefix cache of KV blocks under LOCALKV_HOME/kvcache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

JsonOpt = typer.Option(False, "--json", help="Machine-readable output.")


def _matches(row: dict, model: str | None) -> bool:
    return model is None or row["model"] == model or row["fingerprint"].startswith(model[:16])


@cache_app.command()
def stats(as_json: bool = JsonOpt):
    """Entries, bytes and lifetime hit rate, overall and per model."""
    s = DiskStore().stats()
    if as_json:
        print(json.dumps(s, indent=2))
        return
    q, h = s["query_tokens"], s["hit_tokens"]
    print(f"cache     {s['root']}")
    print(f"entries   {s['entries']}, {format_size(s['bytes'])} of {format_size(s['max_bytes'])}")
    print(f"lifetime  {h} of {q} prompt tokens loaded from disk" + (f" ({h / q:.0%})" if q else ""))
    d = s["damaged"]
    if d["entries"]:
        print(
            f"damaged   {d['entries']} entr{'y' if d['entries'] == 1 else 'ies'}, {format_size(d['bytes'])}: "
            "replaced when next used; `localkv cache clear` removes them now"
        )
    if s["models"]:
        print(f"\n{'MODEL':<24} {'FINGERPRINT':<16} {'ENTRIES':>8} {'SIZE':>10}")
        for m in s["models"]:
            print(f"{m['name']:<24} {m['fingerprint']:<16} {m['entries']:>8} {format_size(m['bytes']):>10}")


@cache_app.command("ls")
def ls(
    as_json: bool = JsonOpt,
    model: str | None = typer.Option(None, "-m", "--model", help="Only this model (name or fingerprint prefix)."),
):
    """List cached blocks, most recently used first."""
    rows = [r for r in DiskStore().ls() if _matches(r, model)]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo("the disk cache is empty" + (f" for {model}" if model else ""), err=True)
        return
    print(f"{'MODEL':<24} {'HASH':<12} {'TOKENS':>6} {'DTYPE':<7} {'SIZE':>10}  LAST USED")
    for r in rows:
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["last_used"]))
        print(
            f"{r['model']:<24} {r['hash']:<12} {r['tokens']:>6} {r['dtype']:<7} {format_size(r['bytes']):>10}  {used}"
        )


@cache_app.command()
def clear(
    model: str | None = typer.Option(
        None, "-m", "--model", help="Only this model (name or fingerprint prefix); default all."
    ),
):
    """Delete cached blocks. Lifetime counters are kept."""
    store = DiskStore()
    n = store.clear(model)
    print(f"removed {n} entr{'y' if n == 1 else 'ies'} ({format_size(store.cleared_bytes)})")
