"""``dsaindex runtime check`` (the check an operator runs before starting a server), ``dsaindex runtime
generate`` (the runtime selecting inside transformers generation) and ``dsaindex runtime quality`` (held-out
NLL and KL with the runtime's selection against the model's exact one; the computation is
:mod:`dsaindex.pipelines.reference.quality`).

All take a model reference (a checkpoint folder, ``reference`` or a preset), so they live with the
pipelines, where models are resolved; the runtime package itself only ever receives a config or a model.
"""

from __future__ import annotations

from pathlib import Path

import typer

from dsaindex.console import at_least
from dsaindex.pipelines.commands import serving_options
from dsaindex.pipelines.commands.serving_options import DECODE, SERVE
from dsaindex.runtime.settings import DecodeSettings, PrefillSettings, ServeSettings

runtime_app = typer.Typer(no_args_is_help=True)


@runtime_app.command("check")
def check_cmd(
    model: str = typer.Option(..., "--model", "-m", help="Served model: checkpoint directory, `reference` or a preset."),
    artifacts: str = typer.Option(..., "--artifacts", "-a",
                                  help="Bundle path, s3://bucket/prefix or models:/<name>@<alias>."),
    device: str = typer.Option("cpu", help="Device to load the artifacts onto."),
    basis: str = typer.Option(SERVE.basis, help="Key basis the engine scores in."),
    allow_other_weights: bool = serving_options.ALLOW_OTHER_WEIGHTS,
    weights: bool = typer.Option(True, "--weights/--config-only",
                                 help="Load the model's weights (on the CPU) to compare its indexer-weights digest "
                                      "with the artifacts', or compare the config digest only (for checkpoints "
                                      "too large to load here)."),
    tracking_uri: str = serving_options.TRACKING_URI,
    recall_target: float = typer.Option(DECODE.recall_target, min=0.0, max=1.0,
                                        help="Also report the C each decode layer would get from `serve "
                                             "--candidates auto` at this held-out recall (or that it would refuse)."),
    prefilter: str = typer.Option(DecodeSettings.prefilter,
                                  help="The server's stage 1 keeps prefilter x C keys: the C reported is the one whose "
                                       "recall with that stage 1 reaches --recall-target; `auto` (the default): the "
                                       "stage 1 and C per layer that `serve` takes by default."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Load the artifacts exactly as a server would and validate them against the model: its config
    (family, indexer geometry, layers) and, unless told otherwise, that it is the model the artifacts
    were trained for (config and indexer-weights digests). For a pq bundle, also the C per layer that
    `serve --candidates auto` would choose from its recorded held-out recall; exit code 2 where that server
    would refuse to start."""
    import json

    from dsaindex.artifacts.bundle import read_manifest
    from dsaindex.artifacts.registry import load_uri
    from dsaindex.pipelines.capture.models import model_config
    from dsaindex.pipelines.commands.serving_options import parse_prefilter
    from dsaindex.runtime.loader import load_bundle

    prefilter = "auto" if prefilter is None else parse_prefilter(prefilter, "auto")  # refused before anything loads

    config = model_config(model)
    served = None
    if weights and not allow_other_weights:
        from dsaindex.artifacts.compat import check_bundle_for_model
        from dsaindex.pipelines.capture.models import load_model

        manifest = read_manifest(load_uri(artifacts, tracking_uri=tracking_uri))
        check_bundle_for_model(manifest, config, basis, allow_other_weights=True)  # the config's refusals first
        # the digest of the weights as the artifacts' model was run (presets' random weights round with the dtype)
        dtype = manifest.model.dtype if manifest.model.dtype in ("float32", "bfloat16") else "float32"
        served = load_model(model, dtype=dtype).fingerprint
    loaded = load_bundle(artifacts, config, device=device, basis=basis, tracking_uri=tracking_uri, served=served,
                         allow_other_weights=allow_other_weights)
    summary = loaded.summary()
    same = ("not compared (--allow-other-weights)" if allow_other_weights
            else "same weights and config" if served else "same config (weights not compared)")
    summary["model_identity"] = same
    auto = _auto_candidates(loaded, config, recall_target, prefilter, device)
    if auto is not None:
        summary["candidates_auto"] = auto
    refused = auto is not None and "refused" in auto
    if as_json:
        print(json.dumps(summary, indent=2))
        if refused:  # the server this describes would not start: say so in the exit code too
            raise typer.Exit(2)
        return
    typer.echo(f"ok: {summary['bundle']} fits {model} ({same}): {summary['family']}, {summary['basis']} basis, "
               f"{summary['key_format']}; layers {loaded.describe_layers()}; {summary['device_bytes']:,} bytes on "
               f"{device}; loaded in {summary['startup_seconds'] * 1000:.1f} ms")
    if auto is not None:
        head = f"--candidates auto at {100 * recall_target:.2f}% held-out recall (prefilter {prefilter})"
        if refused:
            typer.echo(f"{head}: a server would refuse to start. {auto['refused']}")
            raise typer.Exit(2)
        if "unmeasured" in auto:
            typer.echo(f"{head}: {auto['unmeasured']}.")
            return
        else:
            by_c: dict[int, list[str]] = {}
            for layer, c in auto["per_layer"].items():
                by_c.setdefault(c, []).append(layer)
            line = ", ".join(f"C = {c} (layers {', '.join(layers)})" for c, layers in sorted(by_c.items()))
            if "prefilter_per_layer" in auto:
                by_p: dict[int, list[str]] = {}
                for layer, p in auto["prefilter_per_layer"].items():
                    by_p.setdefault(p, []).append(layer)
                line += "; stage 1 " + ", ".join(f"{p} x C (layers {', '.join(layers)})" for p, layers in sorted(by_p.items()))
            if "stage1_per_layer" in auto:
                by_s: dict[str, list[str]] = {}
                for layer, kind in auto["stage1_per_layer"].items():
                    by_s.setdefault(kind, []).append(layer)
                line += "; stage 1 by " + ", ".join(f"{kind} (layers {', '.join(layers)})"
                                                    for kind, layers in sorted(by_s.items()))
            by_band: dict[int, list[str]] = {}
            for layer, band in auto.get("grows_past", {}).items():
                by_band.setdefault(band, []).append(layer)
            if by_band:  # the end of the prefixes the recall was measured at: C grows past it by default
                line += "; C doubles with each doubling of the prefix past " + ", ".join(
                    f"{band:,} keys (layers {', '.join(layers)})" for band, layers in sorted(by_band.items()))
            typer.echo(f"{head}: {line}")


def _auto_candidates(loaded, config, target: float, prefilter: str | int = DECODE.prefilter,
                     device: str = "cpu") -> dict | None:
    # ``prefilter`` as ``parse_prefilter`` returns it: a factor, or "auto"
    """For a bundle with pq layers: {"target", "prefilter", "per_layer": {layer: C}} as ``serve --candidates
    auto --prefilter P`` would choose on ``device`` (with ``auto``, also "prefilter_per_layer": {layer: P} and
    "stage1_per_layer": {layer: what stage 1 scores}), {"target",
    "prefilter", "refused": message} where its recorded recall reaches the target at no C, or {"target",
    "prefilter", "unmeasured": message} where it records none; None for other bundles."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.geometry import geometry_from_config
    from dsaindex.runtime.loader import decode_settings, growth_bands
    from dsaindex.runtime.operating_points import OperatingPoints

    topk = geometry_from_config(config).topk
    layers = [layer for layer in loaded.layers if loaded.kind_of(layer).role == "decode"]
    measured = {p.layer for p in OperatingPoints.from_metrics(loaded.manifest.metrics).points if p.topk == topk}
    if layers and not measured & set(layers):  # nothing to choose from: a server takes a number of candidates
        return {"target": target, "prefilter": prefilter,
                "unmeasured": f"the bundle records no held-out recall of the top-{topk}, so `--candidates auto` "
                              "cannot choose C from it; a number of candidates serves it"}
    try:
        from dsaindex.runtime.paged_select import fold_scan_unavailable

        chosen, factors, stages = decode_settings(
            DecodeSettings(candidates="auto", prefilter=prefilter, recall_target=target), loaded, topk,
            folds=fold_scan_unavailable(device))
    except DsaIndexError as err:
        return {"target": target, "prefilter": prefilter, "refused": str(err)}
    if not chosen:
        return None
    out = {"target": target, "prefilter": prefilter, "per_layer": {str(layer): c for layer, c in chosen.items()}}
    if prefilter == "auto":
        out["prefilter_per_layer"] = {str(layer): p for layer, p in factors.items()}
        out["stage1_per_layer"] = {str(layer): kind for layer, kind in stages.items()}
    bands = growth_bands(loaded.manifest.metrics, chosen, factors, topk, stages)
    if any(bands.values()):  # where C grows by default (the plugins' DSAINDEX_LONG_PREFIX, serve's --long-prefix)
        out["grows_past"] = {str(layer): band for layer, band in bands.items() if band}
    return out


def _heldout_text(corpus: Path | None, config, tokens: int, tokenizer=None):
    """(held-out tokens, begin token, decoder of token lists to text): of a ``dsaindex reference corpus``
    folder whose vocabulary the model holds, or of the byte-level reference corpus; a model with its own
    ``tokenizer`` (v2) and no corpus is refused
    (:func:`~dsaindex.pipelines.reference.train.checkpoint_streams`)."""
    from dsaindex.pipelines.capture.models import ByteTokenizer
    from dsaindex.pipelines.capture.tokens import checkpoint_streams

    own = None if tokenizer is None or isinstance(tokenizer, ByteTokenizer) else tokenizer.name
    streams, vocab = checkpoint_streams("The model", own, corpus, int(config.vocab_size), 0, max(200_000, 2 * tokens))
    if vocab.tokenizer is None:
        from dsaindex.runtime.transformers_adapter import byte_text

        return streams.heldout, vocab.bos, byte_text
    from tokenizers import Tokenizer

    return streams.heldout, vocab.bos, Tokenizer.from_file(str(vocab.tokenizer)).decode


@runtime_app.command("generate")
def generate_cmd(
    artifacts: str = typer.Option(..., "--artifacts", "-a", help="PQ bundle path or models:/<name>@<alias>."),
    model: str = serving_options.MODEL,
    prompt_tokens: int = typer.Option(3072, callback=at_least(2),
                                      help="Prompt length in tokens (a begin token, then held-out text: of --corpus, "
                                           "or of the byte-level corpus of reference-v1)."),
    corpus: Path = typer.Option(None, help="Take the prompt and its continuation from the held-out split of this "
                                           "`dsaindex reference corpus` folder, in its tokens (the data of v2, the "
                                           "default reference; needed by any model with its own tokenizer) "
                                           "instead of the byte-level corpus of reference-v1."),
    prompt_offset: int = typer.Option(0, callback=at_least(0),
                                      help="Where in the held-out text the prompt starts (tokens)."),
    new_tokens: int = typer.Option(300, callback=at_least(1), help="Tokens generated greedily."),
    candidates: str = serving_options.CANDIDATES,
    prefilter: str = serving_options.PREFILTER,
    stage1: str = serving_options.STAGE1,
    recall_target: float = serving_options.RECALL_TARGET,
    exact_below: int = serving_options.EXACT_BELOW,
    long_prefix: str = serving_options.LONG_PREFIX,
    topk: int = serving_options.TOPK,
    device: str = serving_options.DEVICE,
    basis: str = serving_options.BASIS,
    allow_other_weights: bool = serving_options.ALLOW_OTHER_WEIGHTS,
    progress: bool = typer.Option(True, help="Show a progress bar (per generated token) on stderr."),
    ivf_artifacts: str = typer.Option(None, "--ivf-artifacts",
                                      help="An ivf bundle too: whole requests are served as `dsaindex serve` "
                                           "serves them (IVF prefill, PQ decode), and the recall is reported "
                                           "per phase."),
    ivf_budget: int = serving_options.IVF_BUDGET,
    ivf_recall_target: float = serving_options.IVF_RECALL_TARGET,
    # not the server's PREFILL_CHUNK: here no chunk (the default) feeds the whole prompt at once
    prefill_chunk: int = typer.Option(None, callback=at_least(1),
                                      help="Feed the prompt in chunks of this many tokens (default: at once)."),
    out: str = typer.Option(None, help="Also write the JSON result to this file."),
) -> None:
    """Greedy generation with the runtime choosing every layer's decode-time top-k (and with
    --ivf-artifacts, its prefill top-k), against the model's own exhaustive selection: token agreement
    (free running, teacher forced, and on the real held-out continuation) and per-layer recall of the
    model's own top-k."""
    import json

    import torch

    from dsaindex.console import progress_bar
    from dsaindex.geometry import geometry_from_config
    from dsaindex.runtime.loader import decode_settings, describe_points, growth_bands, load_bundle
    from dsaindex.runtime.paged_select import fold_scan_unavailable, growth_limit
    from dsaindex.runtime.transformers_adapter import greedy_agreement

    # refused before anything loads
    asked = serving_options.parse_decode(candidates, prefilter, recall_target, long_prefix=long_prefix,
                                         stage1=stage1)
    loaded_model, dev = serving_options.load_served_model(model, device, topk)
    net, served = loaded_model.model, loaded_model.fingerprint
    heldout, bos, decode = _heldout_text(corpus, net.config, prompt_offset + prompt_tokens + new_tokens,
                                         loaded_model.tokenizer)
    loaded = load_bundle(artifacts, net.config, device=dev, basis=basis, served=served,
                         allow_other_weights=allow_other_weights)
    topk_now = geometry_from_config(net.config).topk
    # per layer; refused where none reaches
    candidates, prefilter, stage1 = decode_settings(asked, loaded, topk_now, folds=fold_scan_unavailable(dev))
    grow = {}  # whole requests (--ivf-artifacts) are served as `serve` serves them: C grown past the band
    if ivf_artifacts is not None and asked.long_prefix == "grow":
        grow = {layer: (band, growth_limit(max(candidates[layer], topk_now)))
                for layer, band in growth_bands(loaded.manifest.metrics, candidates, prefilter, topk_now,
                                                stage1).items()}
    said = describe_points(loaded.manifest.metrics, candidates, prefilter, topk_now, recall_target, grow=grow,
                           stage1=stage1)
    typer.echo(f"decode points: {said}", err=True)
    if len(heldout) < prompt_offset + prompt_tokens + new_tokens:
        from dsaindex.errors import DsaIndexError

        raise DsaIndexError(f"The held-out text has {len(heldout):,} tokens, fewer than --prompt-offset + "
                            f"--prompt-tokens + --new-tokens ({prompt_offset + prompt_tokens + new_tokens:,}).",
                            "lower --prompt-offset, --prompt-tokens or --new-tokens.")
    window = [int(t) for t in heldout[prompt_offset : prompt_offset + prompt_tokens - 1 + new_tokens]]
    prompt = torch.tensor([bos] + window[: prompt_tokens - 1], dtype=torch.long)
    continuation = torch.tensor(window[prompt_tokens - 1 :], dtype=torch.long)
    selection = None
    if ivf_artifacts is not None:
        from dsaindex.runtime.serving import serve_index

        settings = ServeSettings(
            decode=DecodeSettings(candidates=candidates, prefilter=prefilter, stage1=stage1, exact_below=exact_below,
                                  long_prefix=asked.long_prefix),
            prefill=PrefillSettings(ivf_budget=ivf_budget, ivf_recall_target=ivf_recall_target), basis=basis,
            allow_other_weights=allow_other_weights, measure_recall=True, max_keys=prompt_tokens + new_tokens + 1)

        def selection():
            return serve_index([artifacts, ivf_artifacts], net, settings, device=dev, served=served)

    with progress_bar("generate", enabled=progress) as update:
        result = greedy_agreement(net, loaded.layers, prompt, new_tokens, basis=basis, candidates=candidates,
                                  prefilter=prefilter, stage1=stage1, device=dev, continuation=continuation,
                                  progress=update,
                                  exact_below=exact_below, selection=selection, prefill_chunk=prefill_chunk,
                                  decode=decode)
    if ivf_artifacts is not None:
        result["ivf_artifacts"] = ivf_artifacts
        result["served"] = selection().describe()
    result["model"] = model
    result["artifacts"] = artifacts
    text = json.dumps(result, indent=2)
    if out:
        Path(out).write_text(text)
    print(text)


def _parse_lengths(text: str, limit: int) -> list[int]:
    """``--lengths``: comma-separated token counts (``32768``, ``32K``) or ``max`` (the checkpoint's
    ``max_position_embeddings``, ``limit``), each refused above ``limit``."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.runtime.settings import parse_count

    lengths = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        length = limit if part.lower() == "max" else parse_count(part, "--lengths")
        if length > limit:
            raise DsaIndexError(f"--lengths {part} is beyond the checkpoint's longest sequence "
                                f"(max_position_embeddings {limit:,}).",
                                f"pass lengths of at most {limit:,} tokens, or `max`.")
        lengths.append(length)
    if not lengths:
        raise DsaIndexError(f"--lengths {text!r} names no length.", "pass e.g. --lengths 32768,max.")
    return sorted(set(lengths))


def _quality_table(result: dict) -> object:
    """A rich table of ``runtime quality``'s result: per length, a row per prefix band and one for all its
    positions; then every position."""
    from rich import box
    from rich.table import Table

    def short(n: int) -> str:
        return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else f"{n:,}"

    def cells(row: dict) -> list[str]:
        if not row["positions"]:
            return [f"{row['positions']:,}", "-", "-", "-", "-", "-"]
        delta = "-" if row["nll_delta_pct"] is None else f"{row['nll_delta_pct']:+.3f}%"
        return [f"{row['positions']:,}", f"{row['nll_exact']:.4f}", f"{row['nll_runtime']:.4f}", delta,
                f"{row['kl']:.1e}", f"{row['kl_max']:.1e}"]

    table = Table(title=f"held-out NLL, exact vs runtime selection: {result['model']}, top-{result['topk']}, "
                        f"positions with {result['min_prefix']:,}+ tokens before them",
                  title_justify="left", box=box.SIMPLE_HEAD, caption_justify="left",
                  caption="prefix lo-hi: positions with lo to hi - 1 tokens before them; NLL: nats per token, "
                          "teacher forced (the prompt prefilled, then a decode step per token); ΔNLL: runtime vs exact; KL: KL(p_exact || p_runtime) of the next-token "
                          "distributions in nats, mean and max over the positions.")
    for col in ("length", "prefix", "scored", "NLL\nexact", "NLL\nruntime", "ΔNLL", "KL\nmean", "KL\nmax"):
        table.add_column(col, justify="left" if col in ("length", "prefix") else "right")
    for entry in result["lengths"]:
        docs = len(entry["documents"])
        label = f"{entry['length']:,}"
        for band in entry["bands"]:
            lo, hi = band["prefix"]
            table.add_row(label, f"{short(lo)}-{short(hi)}", *cells(band))
            label = ""
        table.add_row(f"({docs} doc{'s' if docs > 1 else ''})", "[bold]all[/bold]", *cells(entry["all"]),
                      end_section=True)
    table.add_row("[bold]overall[/bold]", "", *cells(result["overall"]))
    return table


@runtime_app.command("quality")
def quality_cmd(
    artifacts: list[str] = serving_options.ARTIFACTS,
    model: str = serving_options.MODEL,
    corpus: Path = typer.Option(None, help="The held-out documents of this `dsaindex reference corpus` folder, in its "
                                           "tokens (needed by a model with its own tokenizer, such as v2, the default "
                                           "reference); default: the byte-token Python sources (reference-v1)."),
    lengths: str = typer.Option("32768,max",
                                help="Evaluated lengths in tokens, comma-separated (32768 or 32K; `max`: the "
                                     "checkpoint's longest sequence). Each takes held-out documents at least that "
                                     "long, cut to it."),
    documents: int = typer.Option(2, callback=at_least(1),
                                  help="Held-out documents per length (the first ones, in split order, that long)."),
    min_prefix: int = typer.Option(None, callback=at_least(2),
                                   help="Score the positions with at least this many tokens before them (default: "
                                        "top-k + 1, the first position where selection drops a key). The tokens "
                                        "before the first are the prompt, prefilled as a server would."),
    candidates: str = serving_options.CANDIDATES,
    prefilter: str = serving_options.PREFILTER,
    stage1: str = serving_options.STAGE1,
    recall_target: float = serving_options.RECALL_TARGET,
    exact_below: int = serving_options.EXACT_BELOW,
    long_prefix: str = serving_options.LONG_PREFIX,
    ivf_budget: int = serving_options.IVF_BUDGET,
    ivf_recall_target: float = serving_options.IVF_RECALL_TARGET,
    prefill_chunk: int = serving_options.PREFILL_CHUNK,
    topk: int = serving_options.TOPK,
    device: str = serving_options.DEVICE,
    basis: str = serving_options.BASIS,
    allow_other_weights: bool = serving_options.ALLOW_OTHER_WEIGHTS,
    tracking_uri: str = serving_options.TRACKING_URI,
    recall: bool = typer.Option(True, "--recall/--no-recall",
                                help="Also report each layer's recall of the model's own top-k at the scored "
                                     "steps (the model's own indexer then runs in the runtime's forwards too)."),
    progress: bool = typer.Option(True, help="Show a progress bar (per scored position) on stderr."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON instead of the table."),
    out: Path = typer.Option(None, help="Also write the JSON result to this file."),
) -> None:
    """Held-out negative log-likelihood of the model with the runtime's selection against its own exact
    selection, on long held-out documents: per evaluated length and prefix band, the NLL per token of
    both (teacher forced: the prompt prefilled, then one decode step per token, the runtime serving each
    step as `serve` would at its default settings), their relative difference and the mean KL divergence
    of the runtime's next-token distribution from the exact one."""
    import json

    from dsaindex.console import progress_bar
    from dsaindex.errors import DsaIndexError
    from dsaindex.geometry import geometry_from_config
    from dsaindex.pipelines.capture.models import model_config
    from dsaindex.pipelines.reference.quality import (
        heldout_stream,
        heldout_titles,
        measure_quality,
        pick_documents,
    )
    from dsaindex.runtime import server
    from dsaindex.runtime.serving import serve_index

    # refused before anything loads: the settings, the model reference, lengths beyond its positions
    decode = serving_options.parse_decode(candidates, prefilter, recall_target, exact_below=exact_below,
                                          long_prefix=long_prefix, stage1=stage1)
    serving_options.check_locations(artifacts)
    if out is not None and not out.parent.is_dir():
        raise DsaIndexError(f"--out {out}: the folder {out.parent} does not exist.", "create it, or pass another path.")
    config = model_config(model)
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    limit = int(get("max_position_embeddings", 0) or 0) or 1 << 17
    wanted = _parse_lengths(lengths, limit)
    k = topk or geometry_from_config(config).topk
    first = min_prefix if min_prefix is not None else k + 1
    if first >= wanted[0]:
        raise DsaIndexError(f"--min-prefix {first:,} leaves no position to score at a length of {wanted[0]:,}.",
                            f"pass --lengths above {first:,}, or a smaller --min-prefix.")

    loaded_model, dev = serving_options.load_served_model(model, device, topk)
    net, served = loaded_model.model, loaded_model.fingerprint
    settings = ServeSettings(decode=decode, prefill=PrefillSettings(ivf_budget=ivf_budget,
                                                                    ivf_recall_target=ivf_recall_target),
                             basis=basis, allow_other_weights=allow_other_weights, tracking_uri=tracking_uri,
                             measure_recall=recall, max_keys=wanted[-1] + 1)
    index = serve_index(artifacts, net, settings, name=loaded_model.name, device=dev, served=served)
    stream, bos, eos = heldout_stream(corpus, int(net.config.vocab_size), loaded_model.tokenizer)
    titles = heldout_titles(corpus)
    docs = {length: pick_documents(stream, eos, bos, length, documents, titles) for length in wanted}
    chunk = server.prefill_chunk(net.config, prefill_chunk)
    typer.echo(f"runtime: {index.describe()}; prompts prefilled {chunk:,} tokens at a time", err=True)
    with progress_bar("quality", enabled=progress and not as_json, unit="positions") as update:
        result = measure_quality(net, index, docs, first, chunk, update)
    report = {"model": model, "artifacts": list(artifacts), "corpus": None if corpus is None else str(corpus),
              "topk": int(geometry_from_config(net.config).topk), "min_prefix": first, "prefill_chunk": chunk,
              "runtime": index.describe(), "candidates": {str(layer): c for layer, c in index.candidates.items()},
              "prefilter": {str(layer): p for layer, p in index.prefilter.items()},
              "stage1": {str(layer): kind for layer, kind in index.stage1.items()},
              **({"ivf_budget": index.ivf_budget} if index.prefill_layers else {}), **result}
    text = json.dumps(report, indent=2)
    if out:
        out.write_text(text)
    if as_json:
        print(text)
        return
    from rich.console import Console

    console = Console()
    console.print(_quality_table(report))
    for entry in report["lengths"]:
        for phase, layers in entry.get("selection_recall", {}).items():
            shares = ", ".join(f"{layer}: {share:.2%}" for layer, share in layers.items())
            console.print(f"length {entry['length']:,}, {phase} recall of the model's own top-k by layer: {shares}")
    if out:
        console.print(f"result: {out}")
