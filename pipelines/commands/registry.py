"""``dsaindex registry ...``: browse, compare, promote and pull registered artifacts."""

from __future__ import annotations

import typer

registry_app = typer.Typer(no_args_is_help=True)

_URI_HELP = "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite under ./runs/mlflow)."
_JSON_HELP = "Print JSON instead of a table."


@registry_app.command("list")
def registry_list(
    name: str = typer.Option(None, "--name", help="Only versions of this registered name."),
    tracking_uri: str = typer.Option(None, "--tracking-uri", help=_URI_HELP),
    as_json: bool = typer.Option(False, "--json", help=_JSON_HELP),
) -> None:
    """Registered bundles: name, version, aliases, layers and headline recall."""
    from dsaindex.artifacts.registry import check_store_location, list_versions

    uri = check_store_location(tracking_uri)
    rows = list_versions(name, uri)
    if as_json:
        from dsaindex.console import print_json

        print_json(rows)
        typer.echo(f"registry {uri}: {_count(len(rows), 'version')}", err=True)
        return
    _print_versions(uri, rows)


def _layer_ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"0-3,7"``: the 61 layers of a real model fit a column."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _print_versions(uri: str, rows: list[dict]) -> None:
    """One table per registered name (its model in the title), within 80 columns."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from dsaindex.artifacts.registry import headline_metrics, sqlite_path

    console = Console()
    if not rows:
        db = sqlite_path(uri)
        absent = " (its database file does not exist yet)" if db is not None and not db.exists() else ""
        console.print(f"no registered bundles in {uri}{absent}", soft_wrap=True, highlight=False)
        return
    names = list(dict.fromkeys(r["name"] for r in rows))
    console.print(f"registry {uri}: {_count(len(rows), 'version')} of {_count(len(names), 'name')}",
                  soft_wrap=True, highlight=False)
    for name in names:
        mine = [r for r in rows if r["name"] == name]
        first = mine[0]
        table = Table(title=f"{name}\n{first['model']} ({first['family']})", title_justify="left",
                      box=box.SIMPLE_HEAD, pad_edge=False, highlight=False)
        table.add_column("ver", justify="right")
        table.add_column("aliases", overflow="fold")
        table.add_column("created (UTC)", no_wrap=True)
        table.add_column("layers", overflow="fold")
        table.add_column("recall / headline metrics", overflow="fold")
        for r in mine:
            created = (r["created"] or "")[:16].replace("T", " ")
            metrics = "\n".join(f"{label} {value:.4g}" for label, value in headline_metrics(r["metrics"]))
            table.add_row(str(r["version"]), " ".join(f"@{a}" for a in r["aliases"]), created,
                          f"{_layer_ranges(r['layers'])} {'/'.join(r['kinds'])}".strip(), metrics or "-")
        console.print(table)


@registry_app.command("register")
def registry_register(
    bundle: str = typer.Argument(..., help="An artifact bundle folder (as written by `dsaindex train pq/ivf`), or "
                                          "its s3://bucket/prefix."),
    tracking_uri: str = typer.Option(None, "--tracking-uri", help=_URI_HELP),
) -> None:
    """Register a bundle as a new version (@candidate); a bundle already registered keeps its version."""
    from dsaindex.artifacts.registry import register_bundle
    from dsaindex.artifacts.storage import location

    r = register_bundle(location(bundle), {}, {}, [], tracking_uri)
    alias = f"@{r['alias']}" if r["alias"] else "(no alias)"
    typer.echo(f"{r['name']} version {r['version']} {alias}" + (" (already registered)" if r["existing"] else ""))


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
    dest: str = typer.Argument(..., help="Folder to create for the bundle (must not exist, or be empty), or an "
                                        "empty s3://bucket/prefix."),
    tracking_uri: str = typer.Option(None, "--tracking-uri", help=_URI_HELP),
) -> None:
    """Download a bundle and verify every checksum."""
    from dsaindex.artifacts.registry import pull
    from dsaindex.artifacts.storage import location

    typer.echo(str(pull(name, ref, location(dest), tracking_uri)))


@registry_app.command("ui")
def registry_ui(
    port: int = typer.Option(5000, "--port", help="Port on 127.0.0.1."),
    tracking_uri: str = typer.Option(None, "--tracking-uri", help=_URI_HELP),
) -> None:
    """Run the MLflow UI on http://127.0.0.1:PORT over the registry's store (stops with this process)."""
    from dsaindex.artifacts.registry import resolve_tracking_uri
    from dsaindex.artifacts.registry_ui import ui

    typer.echo(f"starting the MLflow UI on http://127.0.0.1:{port} over {resolve_tracking_uri(tracking_uri)} "
               "(Ctrl-C to stop)", err=True)

    def ready(url: str, pgid: int) -> None:
        typer.echo(f"ready at {url} (server process group {pgid})")

    raise typer.Exit(ui(port, tracking_uri, on_ready=ready))
