"""``dsaindex runtime check``: the check an operator runs before starting a server."""

from __future__ import annotations

import typer

runtime_app = typer.Typer(no_args_is_help=True)


@runtime_app.command("check")
def check_cmd(
    model: str = typer.Option(..., "--model", "-m", help="Served model: checkpoint directory, `reference` or a preset."),
    artifacts: str = typer.Option(..., "--artifacts", "-a", help="Bundle path or models:/<name>@<alias>."),
    device: str = typer.Option("cpu", help="Device to load the artifacts onto."),
    basis: str = typer.Option("hadamard", help="Key basis the engine scores in."),
    tracking_uri: str = typer.Option(None, help="MLflow tracking URI for models:/ URIs."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Load the artifacts exactly as a server would and validate them against the model's config."""
    import json
    from pathlib import Path

    from dsaindex.pipelines.models import preset_config, resolve_model_dir
    from dsaindex.runtime.loader import load

    if model.startswith("preset:"):
        config = preset_config(model.split(":", 1)[1])
    else:
        config = json.loads((Path(resolve_model_dir(model)) / "config.json").read_text())
    loaded = load(artifacts, config, device=device, basis=basis, tracking_uri=tracking_uri)
    summary = loaded.summary()
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    layers = ", ".join(f"{k} (PQ{v['subspaces']}{' score-aware' if v['score_aware'] else ''})"
                       for k, v in summary["layers"].items())
    typer.echo(f"ok: {summary['bundle']} fits {model}: {summary['family']}, {summary['basis']} basis, "
               f"{summary['key_format']}; layers {layers}; {summary['device_bytes']:,} bytes on {device}; "
               f"loaded in {summary['startup_seconds'] * 1000:.1f} ms")
