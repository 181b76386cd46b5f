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


def parse_ints(text: str, option: str, minimum: int | None = None) -> list[int]:
    """``"1024,2048"`` -> ``[1024, 2048]``; anything else, or a value below ``minimum``, is a
    :class:`DsaIndexError` naming ``option``."""
    return _parse_list(text, option, int, "integers", "1024,2048", minimum)


def parse_floats(text: str, option: str, minimum: float | None = None) -> list[float]:
    """``"1,1.5"`` -> ``[1.0, 1.5]``; anything else (a value that is not finite, or below ``minimum``) is a
    :class:`DsaIndexError` naming ``option``."""
    return _parse_list(text, option, float, "numbers", "1,1.5", minimum)


def _parse_list(text: str, option: str, cast: Callable[[str], Any], what: str, example: str,
                minimum: float | None) -> list:
    import math

    from dsaindex.errors import DsaIndexError

    try:
        values = [cast(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) for v in values):
        raise DsaIndexError(f"{option} {text!r} is not a comma-separated list of {what}.",
                            f"pass e.g. {option} {example}.")
    if minimum is not None and min(values) < minimum:
        raise DsaIndexError(f"{option} {text!r} holds {min(values)}, below the least sensible value {minimum}.",
                            f"pass values of {minimum} or more to {option}.")
    return values


def at_least(minimum: int) -> Callable[[Any, Any, Any], Any]:
    """A typer option callback that refuses a value below ``minimum`` with a one-line
    :class:`DsaIndexError` (exit code 2) while the command line is parsed, before any work starts.

    ``typer.Option(20, callback=at_least(1), ...)``; ``None`` (an option left unset) passes."""

    def check(ctx: Any, param: Any, value: Any) -> Any:
        if value is not None and value < minimum:
            from dsaindex.errors import DsaIndexError

            name = max(param.opts, key=len) if getattr(param, "opts", None) else param.name
            raise DsaIndexError(f"{name} {value} is below {minimum}.", f"pass {name} {minimum} or more.")
        return value

    import typer  # typer passes the context and parameter by these annotations

    check.__annotations__ = {"ctx": typer.Context, "param": typer.CallbackParam, "value": Any, "return": Any}
    return check


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def save_report(report: dict, out: Path | None = None, markdown: Path | None = None, table: str | None = None) -> str:
    """Write a report's JSON to ``out`` and ``table`` to ``markdown`` (where given); returns the JSON text."""
    text = json.dumps(report, indent=2)
    if out:
        out.write_text(text)
    if markdown and table is not None:
        markdown.write_text(table)
    return text


def emit_report(report: dict, out: Path | None = None, markdown: Path | None = None, table: str | None = None) -> None:
    """Print a benchmark's JSON report; also write it to ``out`` and ``table`` to ``markdown``."""
    print(save_report(report, out, markdown, table))


def markdown_rows(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table: the header row, its rule, then one line per row of cells."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


@contextmanager
def progress_bar(description: str, enabled: bool = True, unit: str = "tokens") -> Iterator[Callable[..., None]]:
    """Yields ``update(done, total, step="")``: a rich bar on stderr (``done`` of ``total`` ``unit``,
    then ``step``, the work running now), silent when disabled. The bar appears at the first update, so
    an error raised by the checks before any work is the first thing printed. On a terminal it redraws
    in place; elsewhere (a pipe, a log file) rich prints its final state."""
    if not enabled:
        yield lambda done, total, step="": None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[step]}"),
        console=Console(stderr=True),
        transient=False,
    )
    task = bar.add_task(description, total=None, step="")

    def update(done: int, total: int, step: str = "") -> None:
        if not bar.live.is_started:
            bar.start()
        bar.update(task, completed=done, total=total, step=step)

    try:
        yield update
    finally:
        if bar.live.is_started:
            bar.stop()


# ---- tables ----------------------------------------------------------------------------------------
RECALL_CAPTION = ("direct: the PQ top-k; rerank@C: the PQ top-C rescored exactly; filter@C: rerank@C after the "
                  "miss filter; fetch@C: share of the C candidates the filter keeps (what a cold cache reads "
                  "from host); -: no held-out query has more than C keys before it.")


def recall_table(rows: list[tuple[str, dict]], k: int, candidates: Sequence[int] = (1024, 2048, 4096),
                 title: str = "", caption: bool = True) -> Any:
    """A rich table of PQ recall metrics (``k{k}/direct``, ``k{k}/rerank@C``, ``k{k}/filter@C``,
    ``k{k}/fetch@C``, headed by those names) for named rows, or a dim note when no row has a query with
    a long enough prefix. Candidate counts ``C <= k`` are left out (there the top-C is the direct
    top-k). Fits 80 columns for up to three C; with ``caption`` a caption says what the columns and
    ``-`` mean."""
    from rich import box
    from rich.table import Table

    candidates = [c for c in candidates if c > k]
    fc = (2048 if 2048 in candidates else max(candidates)) if candidates else None  # C of the filter columns
    rows = [(name, m) for name, m in rows if f"k{k}/direct" in m]
    if not rows:
        return f"[dim]recall of the exact top-{k}: no held-out query has a causal prefix of 4 x {k} keys " \
               f"(capture longer sequences)[/dim]"
    table = Table(title=title or f"recall of the exact top-{k} (held-out queries)", title_justify="left",
                  box=box.SIMPLE_HEAD, caption=RECALL_CAPTION if caption else None, caption_justify="left")
    headers = ["", "direct", *[f"rerank\n@{c}" for c in candidates]]
    headers += [f"filter\n@{fc}", f"fetch\n@{fc}"] if fc else []
    for col in [*headers, "rel.\nMSE"]:
        table.add_column(col, justify="right" if col else "left", overflow="fold")

    def cell(m: dict, name: str, fmt: str) -> str:
        return format(m[name], fmt) if name in m else "-"

    for name, m in rows:
        table.add_row(
            name,
            cell(m, f"k{k}/direct", ".2%"),
            *[cell(m, f"k{k}/rerank@{c}", ".2%") for c in candidates],
            *([cell(m, f"k{k}/filter@{fc}", ".2%"), cell(m, f"k{k}/fetch@{fc}", ".1%")] if fc else []),
            cell(m, "relative_mse", ".4f"),
        )
    return table


def print_recall_tables(per_layer: dict[int, dict], mean: dict, ks: Sequence[int], candidates: Sequence[int],
                        title: str = "", console: Any = None) -> None:
    """One :func:`recall_table` per k: a row per layer, then the mean; the caption under the last table."""
    from rich.console import Console

    console = console or Console()
    rows = [(f"layer {layer}", m) for layer, m in sorted(per_layer.items())] + [("mean", mean)]
    print_tables([recall_table(rows, k, candidates, f"{title} recall of the exact top-{k}".strip(), caption=False)
                  for k in ks], console)
    for k in ks:
        line = served_recall_line(per_layer, mean, k, candidates)
        if line:
            console.print(line)


def served_recall_line(per_layer: dict[int, dict], mean: dict, k: int, candidates: Sequence[int]) -> str | None:
    """One line on the served step's recall (``k{k}/prefilter{P}@{C}``, stage 1 keeping P x C keys) at the C
    of the filter columns: the mean per recorded P and the weakest layer at the smallest P; None where the
    metrics hold none (short prefixes: stage 1 then passes every key)."""
    fc = [c for c in candidates if c > k]
    if not fc:
        return None
    c = 2048 if 2048 in fc else max(fc)
    head = f"k{k}/prefilter"
    factors = sorted({int(name[len(head):].split("@", 1)[0]) for name in mean
                      if name.startswith(head) and name.endswith(f"@{c}")})
    if not factors:
        return None
    means = " / ".join(f"{mean[f'{head}{p}@{c}']:.2%}" for p in factors)
    name = f"{head}{factors[0]}@{c}"
    scored = {layer: m[name] for layer, m in per_layer.items() if name in m}
    weakest = f"; weakest at {factors[0]} x C: layer {min(scored, key=scored.get)} {min(scored.values()):.2%}" if scored else ""
    return (f"served step at C = {c} (stage 1 keeps {' / '.join(map(str, factors))} x C): mean {means}{weakest}; "
            f"what serve --candidates auto reads")


def print_tables(tables: list[Any], console: Any) -> None:
    """Print :func:`recall_table` results, the caption only under the last real table (not a note)."""
    real = [t for t in tables if not isinstance(t, str)]
    if real:
        real[-1].caption = RECALL_CAPTION
    for table in tables:
        console.print(table)


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
    """A rich table of routing recall: a row per method, a column per candidate budget, a caption that
    says what ``-`` means."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, caption_justify="left",
                  caption="share of each held-out query's exact top-k among the candidates a budget of B keys "
                          "routes to; -: no held-out query has more than B keys before it.")
    table.add_column("routing", overflow="fold")
    for b in budgets:
        table.add_column(f"B={b:,}", justify="right", overflow="fold")
    for method, by in mean.items():
        table.add_row(method, *[("-" if by[str(b)] is None else f"{by[str(b)] * 100:.2f}%") for b in budgets])
    return table


def _selection_line(selection: dict | None) -> str:
    """How a store's model selected its attention's keys while it was captured."""
    if not selection:
        return "the model's own exact indexer"
    return (f"the runtime's {selection['kind'].upper()} prefill, {selection['budget']:,} candidates a query "
            f"(bundle {selection['bundle_id']})")


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
        ("prefill selection", _selection_line(s["settings"].get("prefill_selection"))),
        ("store id", f"{s['store_id']} ({s['schema']}, created {s['created_at']})"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
