"""``dsaindex store ...``: inspect capture stores."""

from __future__ import annotations

from pathlib import Path

import typer

store_app = typer.Typer(no_args_is_help=True)


@store_app.command("info")
def info(
    store: Path = typer.Argument(..., help="Path of a capture store."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Model, layers, key/query counts, bytes, dims and corpus of a capture store."""
    from dsaindex.artifacts.capture_store import CaptureStore
    from dsaindex.console import print_json

    summary = CaptureStore.open(store).info()
    if as_json:
        print_json(summary)
        return
    print_store_summary(summary)


def print_store_summary(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from dsaindex.console import human_bytes

    c = s["committed"]
    per_mkeys = s["bytes_on_disk"] / max(1, c["keys"] * len(s["layers"])) * 1e6
    table = Table(title=f"capture store {s['path']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("model", f"{s['model']['name']} ({s['model']['family']}, {s['model']['dtype']}, weights {s['model']['weights_digest']})"),
        ("indexer layers", f"{len(s['layers'])}: {', '.join(map(str, s['layers']))}"),
        ("indexer", f"{s['n_heads']} heads x {s['head_dim']} dims, top-{s['topk']}, key stride {s['key_stride']}"),
        ("keys", f"{s['basis']} basis, {s['key_dtype']}"),
        ("sequences", f"{c['sequences']} ({c['tokens']:,} tokens, seq_len {s['settings']['seq_len']})"),
        ("keys per layer", f"{c['keys']:,}"),
        ("queries per layer", f"{c['queries']:,} sampled"),
        ("on disk", f"{human_bytes(s['bytes_on_disk'])} ({human_bytes(per_mkeys)} per million keys incl. queries)"),
        ("corpus", f"{', '.join(s['corpus']['sources'])}: {s['corpus']['files']} files, {human_bytes(s['corpus']['bytes'])}"),
        ("tokenizer", s["tokenizer"]),
        ("store id", f"{s['store_id']} ({s['schema']}, created {s['created_at']})"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
