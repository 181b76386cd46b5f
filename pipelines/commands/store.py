"""``dsaindex store ...``: inspect capture stores."""

from __future__ import annotations

import typer

store_app = typer.Typer(no_args_is_help=True)


@store_app.command("info")
def info(
    store: str = typer.Argument(..., help="Path of a capture store, or its s3://bucket/prefix."),
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
