"""The serving options that ``dsaindex serve``, ``runtime generate`` and ``runtime quality`` share, each
declared once (flag, default, help), and their resolution: the text forms parsed into
:class:`~dsaindex.runtime.settings.DecodeSettings`, the bundle locations checked, the model loaded as a
server loads it. The runtime commands then measure exactly what a server would serve.

A command names a declaration as its parameter's default (``candidates: str = serving_options.CANDIDATES``,
the parameter named like the declaration); typer reads the flag, default and help from it. ``runtime
check`` takes the few that mean the same there. ``tests/test_serving_options.py`` checks that the three
commands show every shared option as declared here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from dsaindex import coarse
from dsaindex.console import at_least
from dsaindex.runtime.settings import DecodeSettings, PrefillSettings, ServeSettings

if TYPE_CHECKING:
    from dsaindex.pipelines.capture.models import LoadedModel

# the option defaults are the settings' own (one definition: runtime/settings.py)
DECODE, PREFILL, SERVE = DecodeSettings(), PrefillSettings(), ServeSettings()

# the model and the artifacts
MODEL = typer.Option("reference", "--model", "-m", help="`reference`, a checkpoint directory or a preset.")
ARTIFACTS = typer.Option(..., "--artifacts", "-a",
                         help="Bundle path, s3://bucket/prefix or models:/<name>@<alias>; repeat for one pq "
                              "(decode) and one ivf (prefill) bundle.")
DEVICE = typer.Option("auto", help="cuda, cpu or auto.")
BASIS = typer.Option(SERVE.basis, help="Key basis the artifacts were trained in.")
ALLOW_OTHER_WEIGHTS = typer.Option(SERVE.allow_other_weights, "--allow-other-weights",
                                   help="Serve artifacts trained for another model of the same geometry (other "
                                        "weights or config: a deliberate transfer; measure recall there first). "
                                        "Family, dims, layers, basis and key format are still checked.")
TRACKING_URI = typer.Option(SERVE.tracking_uri, help="MLflow tracking URI for models:/ URIs.")
TOPK = typer.Option(None, callback=at_least(1),
                    help="Keys selected per query (default: the model's index_topk).")

# decode: the PQ step
CANDIDATES = typer.Option(DECODE.candidates,
                          help="Decode: C, keys reranked exactly per step and layer, or `auto` (the default): per "
                               "layer, the cheapest point whose held-out recall in the pq bundle reaches "
                               "--recall-target.")
PREFILTER = typer.Option(DecodeSettings.prefilter,
                         help="Decode: stage 1 keeps prefilter x C keys, or `auto` (with --candidates auto): per "
                              "layer, the cheapest stage 1 and C whose held-out recall reaches --recall-target "
                              f"(default: auto with --candidates auto, else {coarse.PREFILTER}).")
STAGE1 = typer.Option(DECODE.stage1, "--stage1",
                      help="Decode: what stage 1 scores: auto (the default: with --prefilter auto, per layer the "
                           "cheapest recorded point by either, the fold scan where the layer's codes fit it and it "
                           "runs here; else the codes), codes (the keys' codes by the head-weighted folded query) "
                           "or folds (the fold scan: the heads grouped by sign and direction, a ReLU per group).")
RECALL_TARGET = typer.Option(DECODE.recall_target, min=0.0, max=1.0,
                             help="With --candidates auto: the held-out recall of the exact top-k each decode "
                                  "layer must reach (at the bundle's longest prefixes too).")
LONG_PREFIX = typer.Option(DECODE.long_prefix, "--long-prefix",
                           help="Decode, past the longest prefix band the pq bundle measured its recall in: grow "
                                "(the default: each request's C doubles with each doubling of its prefix; a step "
                                "with such a request reads its candidates straight from host memory, not through "
                                "the device cache) or fixed.")
EXACT_BELOW = typer.Option(DECODE.exact_below, callback=at_least(0),
                           help="Decode, the length policy: score requests of at most this many keys exactly "
                                "(0, the default: never, so every decode step goes through PQ).")

# prefill: the IVF selection
IVF_BUDGET = typer.Option(PREFILL.ivf_budget, callback=at_least(1),
                          help="Prefill: candidates per query from the ivf bundle's index (default: the smallest "
                               "the ivf bundle records at --ivf-recall-target; 8 x top-k where it records none).")
IVF_RECALL_TARGET = typer.Option(PREFILL.ivf_recall_target, min=0.0, max=1.0,
                                 help="Without --ivf-budget: the held-out prefill recall of the exact top-k the "
                                      "IVF budget must reach, as the ivf bundle records it.")
PREFILL_CHUNK = typer.Option(PREFILL.chunk, callback=at_least(1),
                             help="Prompt tokens prefilled at once (default: the largest power of two up to 4,096 "
                                  "whose attention scores at the model's last position fit in 1 GiB).")


def parse_candidates(value: str) -> int | str:
    """``--candidates``: a positive count, or ``auto``; a :class:`DsaIndexError` naming the fix otherwise."""
    from dsaindex.runtime import settings

    return settings.parse_candidates(value, empty_ok=False)


def parse_prefilter(value: str, candidates: int | str) -> int | str:
    """``--prefilter``: a positive factor, or ``auto`` (only with ``--candidates auto``); a
    :class:`DsaIndexError` naming the fix otherwise (:func:`dsaindex.runtime.settings.parse_prefilter`)."""
    from dsaindex.runtime import settings

    return settings.parse_prefilter(value, candidates, empty_ok=False)


def parse_decode(candidates: str, prefilter: str | None, recall_target: float, **more: Any) -> DecodeSettings:
    """The decode settings the options ask for: ``--candidates`` and ``--prefilter`` parsed (a bad value is
    refused here, before anything loads; no ``--prefilter``: the settings' default for that C), the other
    fields (``stage1``, ``exact_below``, ``filter_width``, ...) as given in ``more``."""
    count = parse_candidates(candidates)
    if "stage1" in more:
        from dsaindex.runtime.settings import parse_stage1

        more["stage1"] = parse_stage1(more["stage1"], "--stage1")
    if "long_prefix" in more:  # named as the option, not as the settings field
        from dsaindex.runtime.settings import parse_long_prefix

        more["long_prefix"] = parse_long_prefix(more["long_prefix"], "--long-prefix")
    return DecodeSettings(candidates=count, recall_target=recall_target,
                          prefilter=None if prefilter is None else parse_prefilter(prefilter, count), **more)


def check_locations(artifacts: list[str]) -> None:
    """Refuse a bundle location of another scheme than s3:// (or a mistyped s3:/x) before the model loads;
    ``models:/`` URIs are the registry's to resolve later."""
    from dsaindex.artifacts.storage import location

    for uri in artifacts:
        if not uri.startswith("models:/"):
            location(uri)


def load_served_model(model: str, device: str, topk: int | None, dtype: str = "float32") -> tuple[LoadedModel, str]:
    """(the loaded model, the device it is on): ``model`` loaded onto ``device`` (``auto``: CUDA where there
    is one), then given ``topk`` keys per query where set. Its ``fingerprint`` is the checkpoint's, taken
    before: ``--topk`` is a serving setting, not another model."""
    from dsaindex.console import resolve_device
    from dsaindex.indexer import set_index_topk
    from dsaindex.pipelines.capture.models import load_model

    dev = resolve_device(device)
    loaded = load_model(model, device=dev, dtype=dtype)
    if topk is not None:
        set_index_topk(loaded.model, topk)
    return loaded, dev
