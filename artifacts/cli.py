"""``dsaindex store ...``: inspect capture stores."""

from __future__ import annotations

from pathlib import Path

import typer

store_app = typer.Typer(no_args_is_help=True)


@store_app.command("info")
def info(
    store: Path = typer.Argument(..., help="Path of a capture store."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    verify: bool = typer.Option(
        True, "--verify/--no-verify",
        help="Read every committed chunk and check its checksum (a damaged store fails here, not in training).",
    ),
) -> None:
    """Model, layers, key/query counts, bytes, dims and corpus of a capture store."""
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.console import print_json, print_store_summary

    capture_store = CaptureStore.open(store)
    chunks = capture_store.verify() if verify else None
    summary = capture_store.info() | {"verified_chunks": chunks}
    if as_json:
        print_json(summary)
        return
    print_store_summary(summary)
    if chunks is not None:
        typer.echo(f"verified: all {chunks} chunks of the committed rows read back intact")


# ---- dsaindex registry ... -------------------------------------------------------------------------
registry_app = typer.Typer(no_args_is_help=True)

_URI_HELP = "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite under ./runs/mlflow)."
_JSON_HELP = "Print JSON instead of a table."


@registry_app.command("list")
def registry_list(
    name: str = typer.Option(None, "--name", help="Only versions of this registered name."),
    tracking_uri: str = typer.Option(None, "--tracking-uri", help=_URI_HELP),
    as_json: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """Registered bundles: name, version, aliases, model, layers and key metrics."""
    from dsaindex.artifacts.registry import list_versions, resolve_tracking_uri
    from dsaindex.console import print_json

    rows = list_versions(name, tracking_uri)
    if as_json:
        print_json(rows)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"registry {resolve_tracking_uri(tracking_uri)}", title_justify="left")
    for col in ("name", "version", "aliases", "created", "model", "layers", "metrics"):
        table.add_column(col, overflow="fold")
    for r in rows:
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in list(r["metrics"].items())[:4])
        table.add_row(r["name"], str(r["version"]), " ".join(f"@{a}" for a in r["aliases"]), r["created"] or "",
                      f"{r['model']} ({r['family']})", ",".join(map(str, r["layers"])) + f" [{'/'.join(r['kinds'])}]",
                      metrics)
    console = Console()
    console.print(table if rows else "no registered bundles")


@registry_app.command("show")
def registry_show(
    name: str = typer.Argument(..., help="Registered name (see `dsaindex registry list`)."),
    ref: str = typer.Argument(..., help="Version number, @alias, alias or 'latest'."),
    tracking_uri: str = typer.Option(None, "--tracking-uri", help=_URI_HELP),
    as_json: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """One version: manifest, metrics, lineage, aliases and run id."""
    from dsaindex.artifacts.registry import show
    from dsaindex.console import print_json

    info = show(name, ref, tracking_uri)
    if as_json:
        print_json(info)
        return
    from rich.console import Console
    from rich.table import Table

    m, lin = info["manifest"], info["lineage"]
    table = Table(title=f"{name} version {info['version']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    rows = [
        ("aliases", " ".join(f"@{a}" for a in info["aliases"]) or "-"),
        ("created", f"{info['created']} (bundle {m['bundle_id']}, {m['schema_id']}/{m['schema_version']}, "
                    f"dsaindex {m['dsaindex_version']})"),
        ("model", f"{m['model']['name']} ({m['model']['family']}, weights {m['model']['weights_digest']})"),
        ("keys", f"{m['basis']} basis, {m['key_format']}"),
        ("layers", ", ".join(f"{k}:{v['kind']}" for k, v in sorted(m["layers"].items(), key=lambda kv: int(kv[0])))),
        ("lineage", f"store {lin['capture_store_id']} (digest {lin['capture_store_digest']}) at "
                    f"{lin['capture_store_path']}; {len(lin['train_sequences'])} train / "
                    f"{len(lin['eval_sequences'])} eval sequences"),
        ("run", f"{info['run_id']} (model {info['model_id']})"),
    ]
    rows += [(f"metric {k}", f"{v:.6g}") for k, v in info["metrics"].items()]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


@registry_app.command("promote")
def registry_promote(
    name: str = typer.Argument(..., help="Registered name."),
    version: str = typer.Argument(..., help="Version number (or @alias) to promote."),
    alias: str = typer.Option("production", "--alias", help="Alias to point at the version."),
    tracking_uri: str = typer.Option(None, "--tracking-uri", help=_URI_HELP),
) -> None:
    """Point an alias (default @production) at a version."""
    from dsaindex.artifacts.registry import promote

    r = promote(name, version, alias, tracking_uri)
    moved = f" (was version {r['previous']})" if r["previous"] is not None else ""
    typer.echo(f"{r['name']}@{r['alias']} -> version {r['version']}{moved}")


@registry_app.command("diff")
def registry_diff(
    name: str = typer.Argument(..., help="Registered name."),
    a: str = typer.Argument(..., help="First version or alias."),
    b: str = typer.Argument(..., help="Second version or alias."),
    tracking_uri: str = typer.Option(None, "--tracking-uri", help=_URI_HELP),
    as_json: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """Per layer: params, metrics and arrays that differ between two versions."""
    from dsaindex.artifacts.registry import diff
    from dsaindex.console import print_json

    d = diff(name, a, b, tracking_uri)
    if as_json:
        print_json(d)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{name}: version {d['a']} vs {d['b']}", title_justify="left")
    for col in ("layer", "what", f"v{d['a']}", f"v{d['b']}"):
        table.add_column(col, overflow="fold")
    for section in ("bundle", "params", "metrics"):
        for key, (x, y) in d[section].items():
            table.add_row("all", f"{section} {key}", str(x), str(y))
    for layer, entry in d["layers"].items():
        for section, part in entry.items():
            if isinstance(part, dict):
                for key, (x, y) in part.items():
                    table.add_row(layer, f"{section} {key}", str(x), str(y))
            else:
                table.add_row(layer, section, str(part[0]), str(part[1]))
    Console().print(table if table.row_count else f"{name}: versions {d['a']} and {d['b']} do not differ")


@registry_app.command("pull")
def registry_pull(
    name: str = typer.Argument(..., help="Registered name."),
    ref: str = typer.Argument(..., help="Version number, @alias, alias or 'latest'."),
    dest: Path = typer.Argument(..., help="Folder to create for the bundle (must not exist, or be empty)."),
    tracking_uri: str = typer.Option(None, "--tracking-uri", help=_URI_HELP),
) -> None:
    """Download a bundle and verify every checksum."""
    from dsaindex.artifacts.registry import pull

    typer.echo(str(pull(name, ref, dest, tracking_uri)))


@registry_app.command("ui")
def registry_ui(
    port: int = typer.Option(5000, "--port", help="Port on 127.0.0.1."),
    tracking_uri: str = typer.Option(None, "--tracking-uri", help=_URI_HELP),
) -> None:
    """Run the MLflow UI on http://127.0.0.1:PORT over the registry's store."""
    from dsaindex.artifacts.registry import ui

    typer.echo(f"MLflow UI on http://127.0.0.1:{port} (Ctrl-C to stop)", err=True)
    raise typer.Exit(ui(port, tracking_uri))
