"""What every command shares at the terminal: device choice, JSON and report printing, tables, progress."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` where a CUDA device is present, else ``cpu``; other names pass through after
    a check that a CUDA device exists when one is named."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError(f"--device {name} was asked for, but this machine has no CUDA device torch can use.",
                            "pass --device cpu (or auto), or install a CUDA build of torch on a GPU machine.")
    return name


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def emit_report(report: dict, out=None, markdown=None, table: str | None = None) -> None:
    """Print a benchmark's JSON report; also write it to ``out`` and ``table`` to ``markdown``."""
    text = json.dumps(report, indent=2)
    if out:
        out.write_text(text)
    if markdown and table is not None:
        markdown.write_text(table)
    print(text)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


@contextmanager
def progress_bar(description: str, enabled: bool = True):
    """Yields ``update(done, total)``; a rich bar on a terminal (stderr), silent when disabled."""
    if not enabled:
        yield lambda done, total: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=False,
    ) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update
