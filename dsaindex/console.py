"""What every command shares at the terminal: device choice, JSON and report printing, tables, progress."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
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


def parse_ints(text: str, option: str) -> list[int]:
    """``"1024,2048"`` -> ``[1024, 2048]``; anything else is a :class:`DsaIndexError` naming ``option``."""
    from dsaindex.errors import DsaIndexError

    try:
        values = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        values = []
    if not values:
        raise DsaIndexError(f"{option} {text!r} is not a comma-separated list of integers.",
                            f"pass e.g. {option} 1024,2048.")
    return values


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def emit_report(report: dict, out: Path | None = None, markdown: Path | None = None, table: str | None = None) -> None:
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
def progress_bar(description: str, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
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


# ---- tables ----------------------------------------------------------------------------------------
def recall_table(rows: list[tuple[str, dict]], k: int, candidates: Sequence[int] = (1024, 2048, 4096),
                 title: str = "") -> Any:
    """A rich table of PQ recall metrics (``k{k}/direct``, ``k{k}/rerank@C``, ...) for named rows, or a
    dim note when no row has a query with a long enough prefix."""
    from rich.table import Table

    fc = 2048 if 2048 in candidates else max(candidates)  # C of the miss-filter columns
    table = Table(title=title or f"recall of the exact top-{k} (held-out queries)", title_justify="left")
    for col in ["", "direct PQ", *[f"rerank C={c}" for c in candidates], f"+filter C={fc}", f"fetch C={fc}", "rel. MSE"]:
        table.add_column(col, justify="right" if col else "left")
    rows = [(name, m) for name, m in rows if f"k{k}/direct" in m]
    if not rows:
        return f"[dim]recall of the exact top-{k}: no held-out query has a causal prefix of 4 x {k} keys " \
               f"(capture longer sequences)[/dim]"
    for name, m in rows:
        table.add_row(
            name,
            f"{m[f'k{k}/direct']:.2%}",
            *[f"{m[f'k{k}/rerank@{c}']:.2%}" if f"k{k}/rerank@{c}" in m else "-" for c in candidates],
            f"{m[f'k{k}/filter@{fc}']:.2%}" if f"k{k}/filter@{fc}" in m else "-",
            f"{m[f'k{k}/fetch@{fc}']:.1%}" if f"k{k}/fetch@{fc}" in m else "-",
            f"{m.get('relative_mse', float('nan')):.4f}",
        )
    return table


def print_recall_tables(per_layer: dict[int, dict], mean: dict, ks: Sequence[int], candidates: Sequence[int],
                        title: str = "", console: Any = None) -> None:
    """One :func:`recall_table` per k: a row per layer, then the mean."""
    from rich.console import Console

    console = console or Console()
    rows = [(f"layer {layer}", m) for layer, m in sorted(per_layer.items())] + [("mean", mean)]
    for k in ks:
        console.print(recall_table(rows, k, candidates, f"{title} recall of the exact top-{k}".strip()))


def print_pq_job(result: Any, name: str, console: Any = None) -> None:
    """The recall tables of a :class:`dsaindex.train.pq_job.PQJobResult`, then its bundle, registration
    and plots."""
    from rich.console import Console

    console = console or Console()
    report = result.report
    print_recall_tables(report["per_layer"], report["mean"], result.ks, result.opts.candidates, name, console)
    registered = result.registered
    console.print(f"bundle: {result.bundle}" + (f"  registered: {registered['name']} v{registered['version']} "
                                                f"@{registered.get('alias', 'candidate')}" if registered else ""))
    for p in result.plots:
        console.print(f"plot: {p}")


def routing_table(mean: dict, budgets: list[int], title: str) -> Any:
    """A rich table of routing recall: a row per method, a column per candidate budget."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("routing")
    for b in budgets:
        table.add_column(f"budget {b:,}", justify="right")
    for method, by in mean.items():
        table.add_row(method, *[("-" if by[str(b)] is None else f"{by[str(b)] * 100:.2f}%") for b in budgets])
    return table


def print_store_summary(s: dict) -> None:
    """A capture store's :meth:`~dsaindex.artifacts.capture_store.CaptureStore.info` as a table."""
    from rich.console import Console
    from rich.table import Table

    c = s["committed"]
    n_keys = max(1, c["keys"] * len(s["layers"]))
    key_bytes = s.get("key_bytes_on_disk", s["bytes_on_disk"])
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
        ("on disk", f"{human_bytes(s['bytes_on_disk'])} in all; keys {human_bytes(key_bytes)} "
                    f"({key_bytes / n_keys:.0f} bytes per key)"),
        ("corpus", f"{', '.join(s['corpus']['sources'])}: {s['corpus']['files']} files, {human_bytes(s['corpus']['bytes'])}"),
        ("tokenizer", s["tokenizer"]),
        ("store id", f"{s['store_id']} ({s['schema']}, created {s['created_at']})"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
