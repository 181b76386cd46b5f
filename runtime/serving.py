"""The runtime inside a served transformers DSA model: whole requests, prefill and decode.

:func:`serve_index` is the entry point a server calls once at startup: it resolves one or more artifact
bundles (paths or ``models:/<name>@<alias>``), verifies and validates each against the served model
(the config, and the model's own indexer weights unless told otherwise) and returns a
:class:`ServedIndex` for that model. Installed (:meth:`ServedIndex.attach`, or as a context manager),
it selects every indexer layer's top-k:

* prefill chunks (more than one new token): through the layer's causal IVF index
  (:class:`dsaindex.runtime.ivf_prefill.IVFPrefillIndexer`, with the learned routing of an ``ivf``
  artifact), queries seeing only keys before them; the index is dropped at the request's first decode
  step (a later prefill chunk of the same request keeps the model's own selection);
* decode steps (one new token): through the layer's PQ coarse-to-fine group
  (:class:`dsaindex.runtime.pq_batch.PQDecodeGroup`, from a ``pq`` artifact): exact index keys of
  completed pages in (pinned) host memory, on the device only the codes, the exact tail and the cache;
* a layer with no artifact of a kind keeps the model's own exact selection for that phase, and
  :meth:`ServedIndex.paths` / :meth:`ServedIndex.describe` say which.

A request starts when a batch row's first new position is 0 (transformers' ``generate`` runs one
prompt, then one token per step); its state is then reset. Rows are request slots. Settings come
typed (:class:`dsaindex.runtime.settings.ServeSettings`, with the decode and prefill settings inside).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from dsaindex.artifacts.kinds import lagged_sources
from dsaindex.errors import ArtifactMismatchError, DsaIndexError
from dsaindex.geometry import geometry_from_config
from dsaindex.hooks import ModuleHooks, PostHook, PreHook, SkipHook
from dsaindex.indexer import find_indexers, mla_indexer_tensors
from dsaindex.pq import PQCodec
from dsaindex.quant import to_basis
from dsaindex.runtime.host_store import HostKeyStore
from dsaindex.runtime.ivf_prefill import IVFPrefillIndexer
from dsaindex.runtime.loader import (
    candidates_for_recall,
    code_bytes_of,
    decode_settings,
    describe_points,
    growth_bands,
    ivf_budget_for_recall,
    per_layer,
    per_layer_text,
)
from dsaindex.runtime.paged_select import fold_scan_unavailable
from dsaindex.runtime.pq_batch import PQDecodeGroup
from dsaindex.runtime.settings import STAGE1_SETTINGS, DecodeSettings, PrefillSettings, ServeSettings

__all__ = ["DecodeSettings", "LayerPaths", "PrefillSettings", "ServeSettings", "ServedIndex", "ServingLog",
           "candidates_for_recall", "serve_index"]


@dataclass(frozen=True)
class LayerPaths:
    """How one indexer layer selects: ``prefill`` is ``ivf`` or ``exact``, ``decode`` ``pq`` or ``exact``."""

    prefill: str
    decode: str


@dataclass
class ServingLog:
    """Per layer: queries the runtime selected for, by phase, and (with ``measure_recall``) the summed
    share of the model's own top-k each selection kept. ``prefill_index_peak``: the most device bytes
    the prefill indexes of every layer and request held at once (each layer's dequantized prefix counted
    while its chunk is selected), with the keys they held then (``prefill_index_keys``, summed over
    layers and requests)."""

    queries: dict[str, dict[int, int]] = field(default_factory=lambda: {"prefill": {}, "decode": {}})
    kept: dict[str, dict[int, float]] = field(default_factory=lambda: {"prefill": {}, "decode": {}})
    prefill_index_peak: int = 0
    prefill_index_keys: int = 0

    def add(self, phase: str, layer: int, queries: int, kept: float | None) -> None:
        self.queries[phase][layer] = self.queries[phase].get(layer, 0) + queries
        if kept is not None:
            self.kept[phase][layer] = self.kept[phase].get(layer, 0.0) + kept

    def recall(self) -> dict[str, dict[int, float]]:
        """Mean share of the model's own top-k kept, per phase and layer (layers with a measurement)."""
        return {phase: {layer: round(total / max(1, self.queries[phase][layer]), 4)
                        for layer, total in self.kept[phase].items()}
                for phase in self.kept}


def _kept_share(picked: torch.Tensor, own: torch.Tensor) -> float:
    """Sum over query rows of |picked & own| / |own| (``picked``, ``own`` [Q, k] positions, -1 = none)."""
    width = int(max(picked.max(), own.max())) + 2
    mine = torch.zeros(picked.shape[0], width, dtype=torch.bool, device=picked.device)
    mine.scatter_(1, picked.clamp_min(-1).long() + 1, True)
    mine[:, 0] = False  # the -1 column
    hit = mine.gather(1, own.long() + 1) & (own >= 0)
    return float((hit.sum(1).float() / (own >= 0).sum(1).clamp_min(1).float()).sum())


def _indexer_cache(a: dict[str, Any]) -> Any:
    """The model's cache among an indexer call's arguments (``cache``, or ``past_key_values`` as some
    transformers releases name it), or None."""
    for name in ("cache", "past_key_values", "past_key_value"):
        if a.get(name) is not None:
            return a[name]
    return None


class ServedIndex(ModuleHooks):
    """The runtime's selection installed in a transformers DSA model (V3.2, GLM-5 classes).

    Parameters
    ----------
    model : the served model; codecs : layer -> :class:`PQCodec` (``pq`` artifacts: decode); routers : layer
    -> :class:`dsaindex.artifacts.kinds.IVFLayer` (``ivf`` artifacts: prefill)
    settings : :class:`ServeSettings`. Its ``decode`` (:class:`DecodeSettings`) sizes the decode groups
    (:class:`PQDecodeGroup`): ``candidates`` and ``prefilter`` one value for every layer or a layer -> value
    mapping (``auto`` is resolved by :func:`serve_index` before this), ``cache_capacity`` default 2 x C. Its
    ``prefill`` (:class:`PrefillSettings`): ``ivf_budget`` candidates per prefill query (default 8 x top-k);
    ``stream_prefix``: layer-wise streamed prefill of the model's own indexer keys (one request at a
    time): they live in pinned host memory (:class:`dsaindex.runtime.streaming.PrefixStreamer`) and
    reach the device through two buffers, the next layer's copy overlapping this layer's compute;
    the model's cache keeps no indexer keys. A layer whose selection the runtime replaces in this
    forward (IVF prefill, PQ decode) reads no prefix (its exact scores are unused), unless
    ``measure_recall`` needs them. The IVF prefill indexes' FP8 key bytes stream the same way (a second
    streamer, rows of D bytes): each layer's index borrows its buffer for the chunk
    (:meth:`CausalIVF.attach`), and on CUDA their refit bounds wait on the host between refits, so
    between chunks the device holds only their scales and versions. The rest: ``basis`` (the artifacts'
    key basis), ``slots`` (requests served at once), ``max_keys`` (the longest request; default the model's
    ``max_position_embeddings``), ``measure_recall`` (also log, per layer and phase, how much of the model's
    own top-k the runtime kept; the model computes its exact selection anyway in transformers), ``lag``
    (the Multi-layer Indexer's schedule over the kept layers, those not in ``reuse``, all of them without a
    plan: every layer attends the selection of the nearest kept layer before it,
    :func:`dsaindex.artifacts.kinds.lagged_sources`, so a kept layer's own selection is first used by the
    next layer and its indexer can run under its own layer's attention; the first kept layer attends its
    own), ``side_stream`` (with ``lag`` on a CUDA device, the default there: each lagged kept layer's
    selection, the model's indexer and the runtime's own work for that layer, runs on a side stream, forked
    when the layer's indexer is called and joined where a later layer first attends it; not with
    ``stream_prefix``), ``use_triton``
    reuse : cross-layer reuse (IndexCache), layer -> the kept layer whose selection it takes (a ``reuse``
    artifact's plan): a layer that reuses takes that layer's final selection of the same forward
    (the runtime's or the model's own) instead of its own; ``measure_recall`` logs how much of its own
    top-k the reused one keeps. Its own indexer still runs in transformers (its output is replaced)
    device : where the runtime's state lives (default: the model's)
    """

    def __init__(self, model: torch.nn.Module, codecs: dict[int, PQCodec], routers: dict[int, Any],
                 settings: ServeSettings | None = None, reuse: dict[int, int] | None = None,
                 device: str | torch.device | None = None):
        settings = settings or ServeSettings()
        decode, prefill = settings.decode, settings.prefill
        if decode.auto and codecs:  # no decode layer: nothing to choose
            raise DsaIndexError("ServedIndex takes C and stage 1 chosen already; `auto` is chosen from a bundle.",
                                "load through serve_index(), which reads the bundle's recall, or pass numbers.")
        slots, lag, stream_prefix = settings.slots, settings.lag, prefill.stream_prefix
        super().__init__()
        self.model = model
        self.geometry = geometry_from_config(model.config)
        self.indexers = find_indexers(model, self.geometry)
        extra = sorted((set(codecs) | set(routers)) - set(self.indexers))
        if extra:
            raise ArtifactMismatchError(f"The artifacts have layers {extra}, which are not indexer layers of the "
                                        f"served model (its indexer layers: {sorted(self.indexers)}).",
                                        "serve artifacts trained for this model.")
        self.reuse = {layer: src for layer, src in (reuse or {}).items() if src != layer}
        bad = {layer: src for layer, src in self.reuse.items() if src not in self.indexers or src > layer}
        if bad or set(self.reuse) - set(self.indexers):
            raise ArtifactMismatchError(f"The reuse plan {self.reuse} names layers that are not earlier indexer "
                                        f"layers of the served model ({sorted(self.indexers)}).",
                                        "serve a reuse plan trained for this model.")
        order = sorted(self.indexers)
        kept = [layer for layer in order if layer not in self.reuse]
        self.lag = lag
        # the layer whose selection each layer attends (absent: its own)
        self.attend = ({layer: src for layer, src in zip(order, lagged_sources(order, kept), strict=True)
                        if src != layer} if lag else dict(self.reuse))
        self._sources = set(self.attend.values())
        # MLI on a side stream: the kept layers whose selection is first attended by a later layer
        self.forked = {layer for layer in kept if self.attend.get(layer, layer) != layer and layer in self._sources}
        self._last: dict[int, torch.Tensor] = {}
        self._past_rows: list[int] = [0]
        # a layer that reuses another's selection needs no state of its own
        self.decode_layers = {layer: c for layer, c in codecs.items() if layer not in self.reuse}
        self.prefill_layers = {layer: x for layer, x in routers.items() if layer not in self.reuse}
        self.settings = settings
        self.basis, self.slots = settings.basis, slots
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.use_triton = use_triton = settings.use_triton
        self.topk = self.geometry.topk
        self.max_keys = settings.max_keys or int(getattr(model.config, "max_position_embeddings", 1 << 17))
        self.ivf_budget = prefill.ivf_budget or 8 * self.topk
        self.measure_recall = settings.measure_recall
        pages = slots * (-(-self.max_keys // 64) + 1)
        self.candidates = per_layer(decode.candidates, self.decode_layers, "candidate count C")
        self.prefilter = per_layer(decode.prefilter, self.decode_layers, "stage-1 prefilter")
        # what each layer's stage 1 scores (``auto`` is chosen by serve_index; given here, it is the codes)
        self.stage1 = {layer: "codes" if kind == "auto" else kind for layer, kind in
                       per_layer_text(decode.stage1, self.decode_layers, "stage 1", STAGE1_SETTINGS).items()}
        # chosen per layer: describe() says which
        self._per_layer_c = isinstance(decode.candidates, Mapping)
        self._per_layer_p = isinstance(decode.prefilter, Mapping)
        self._per_layer_s = isinstance(decode.stage1, Mapping)
        self.points = ""  # each decode layer's point and its recorded recall (serve_index says it at startup)
        self.bundles: dict[str, str] = {}  # where each served bundle came from -> its bundle id (serve_index)
        self.groups = {
            layer: PQDecodeGroup(codec, HostKeyStore(pages, self.geometry.head_dim), slots, self.max_keys,
                                 self.topk, candidates=self.candidates[layer], prefilter=self.prefilter[layer],
                                 stage1=self.stage1[layer],
                                 cache_capacity=decode.cache_capacity or -(-2 * self.candidates[layer] // 4) * 4,
                                 device=self.device, use_triton=use_triton, exact_below=decode.exact_below,
                                 pq_from=decode.pq_from, filter_width=decode.filter_width,
                                 direct_upto=decode.direct_upto)
            for layer, codec in self.decode_layers.items()
        }
        self.ivf: dict[int, list[IVFPrefillIndexer | None]] = {layer: [None] * slots for layer in self.prefill_layers}
        self.log = ServingLog()
        self._chosen: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}
        self._fresh: dict[int, torch.Tensor] = {}  # this call's new index keys per layer (model basis, fp32)
        self.side = None
        self._main: Any = None
        self._done: dict[int, Any] = {}  # kept layer -> the side stream's event after its selection
        side_stream = settings.side_stream
        if side_stream is None:
            side_stream = lag and self.device.type == "cuda"
        if side_stream:
            if not lag or self.device.type != "cuda" or stream_prefix:
                raise DsaIndexError("A side stream serves the MLI lag on a CUDA device, without streamed prefill "
                                    f"(lag={lag}, device {self.device}, stream_prefix={stream_prefix}).",
                                    "pass lag=True on a CUDA device and stream_prefix=False, or side_stream=False.")
            self.side = torch.cuda.Stream(self.device)
        self.streamer = None
        self.ivf_streamer = None
        if stream_prefix:
            if slots != 1:
                raise DsaIndexError(f"Streamed prefill serves one request at a time; got slots={slots}.",
                                    "pass slots=1 with stream_prefix=True.")
            from dsaindex.runtime.streaming import PrefixStreamer

            dtype = next(model.parameters()).dtype
            self.streamer = PrefixStreamer(sorted(self.indexers), (self.geometry.head_dim,), dtype, self.max_keys,
                                           self.device)
            if self.ivf:  # the IVF indexes' FP8 key bytes too: on the host between chunks
                self.ivf_streamer = PrefixStreamer(sorted(self.ivf), (self.geometry.head_dim,), torch.uint8,
                                                   self.max_keys, self.device)

    # ---- what the runtime does per layer ---------------------------------------------------------
    def paths(self) -> dict[int, LayerPaths]:
        """Per indexer layer: ``ivf`` / ``pq``, ``exact`` (the model's own), or ``reuse L`` (layer L's)."""
        return {layer: LayerPaths(f"reuse {self.reuse[layer]}", f"reuse {self.reuse[layer]}") if layer in self.reuse
                else LayerPaths("ivf" if layer in self.prefill_layers else "exact",
                                "pq" if layer in self.decode_layers else "exact")
                for layer in self.indexers}

    def describe(self) -> str:
        """One line per selection path: ``prefill ivf: layers 0-3; decode pq: layers 0-3`` (and exact), and
        where C was chosen per layer, which (``decode C: 2048 (layers 1-2), 4096 (layers 0, 3)``)."""
        parts = []
        for phase in ("prefill", "decode"):
            by_path: dict[str, list[int]] = {}
            for layer, p in self.paths().items():
                if layer not in self.reuse:
                    by_path.setdefault(getattr(p, phase), []).append(layer)
            parts += [f"{phase} {path}: layers {_ranges(layers)}" for path, layers in sorted(by_path.items())]
        if self._per_layer_c and self.candidates:
            by_c: dict[int, list[int]] = {}
            for layer, c in self.candidates.items():
                by_c.setdefault(c, []).append(layer)
            parts.append("decode C: " + ", ".join(f"{c} (layers {_ranges(layers)})" for c, layers in sorted(by_c.items())))
        if self._per_layer_p and self.prefilter:
            by_p: dict[int, list[int]] = {}
            for layer, p in self.prefilter.items():
                by_p.setdefault(p, []).append(layer)
            parts.append("decode stage 1: " + ", ".join(f"{p} x C (layers {_ranges(layers)})"
                                                        for p, layers in sorted(by_p.items())))
        if self._per_layer_s and len(set(self.stage1.values())) > 1:  # one for all: the points say it
            by_s: dict[str, list[int]] = {}
            for layer, kind in self.stage1.items():
                by_s.setdefault(kind, []).append(layer)
            parts.append("decode stage 1 by: " + ", ".join(f"{kind} (layers {_ranges(layers)})"
                                                           for kind, layers in sorted(by_s.items())))
        if self.prefill_layers:
            parts.append(f"prefill IVF budget: {self.ivf_budget:,} candidates a query")
        if self.points:
            parts.append(f"decode points: {self.points}")
        if self.attend:
            parts.append(("attends (MLI lag): " if self.lag else "reuse: ")
                         + ", ".join(f"{layer} <- {src}" for layer, src in sorted(self.attend.items())))
        return "; ".join(parts)

    # ---- hooks -------------------------------------------------------------------------------------
    def attach(self) -> None:
        for layer, module in self.indexers.items():
            if (layer in self.decode_layers or layer in self.prefill_layers or self.streamer is not None
                    or layer in self.attend or layer in self._sources):
                self.register(module, pre=self._before(layer), post=self._after(layer), skip=self._skip(layer))

    def remove(self) -> None:
        """Detach the hooks and free every request's state."""
        super().remove()
        if self._main is not None:  # a forward stopped between a fork and its join
            torch.cuda.set_stream(self._main)
            self._main = None
        if self.side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
            self._done.clear()
        for group in self.groups.values():
            group.free_all()
        for indexers in self.ivf.values():
            indexers[:] = [None] * len(indexers)

    def _start(self, layer: int, slot: int) -> None:
        """A new request in ``slot`` at ``layer``: empty decode state and prefill index."""
        if layer in self.groups:
            group = self.groups[layer]
            if group.pages[slot] is not None:
                group.free(slot)
            group.admit(slot)
        if layer in self.ivf:
            self.ivf[layer][slot] = IVFPrefillIndexer(
                self.geometry.head_dim, self.topk, self.ivf_budget, layer=self.prefill_layers[layer],
                device=self.device, use_triton=self.use_triton,
                key_storage="fp8" if self.ivf_streamer is None else "streamed")

    @staticmethod
    def _past(a: dict[str, Any], new: int) -> list[int]:
        """Keys each batch row held before this call: the first new position (from ``position_ids``, else
        from the cache, which already holds this call's tokens when the indexer runs)."""
        ids = a.get("position_ids")
        rows = a["hidden_states"].shape[0]
        if ids is not None:
            ids = ids.expand(rows, -1) if ids.shape[0] == 1 else ids
            return [int(x) for x in ids[:, 0]]
        cache = _indexer_cache(a)
        seen = int(cache.get_seq_length()) - new if cache is not None else 0
        return [max(0, seen)] * rows

    def _replaces(self, layer: int, new: int, past: int) -> bool:
        """Whether the runtime replaces ``layer``'s selection in a forward of ``new`` tokens after ``past``
        (slot 0: streaming serves one request)."""
        if layer in self.reuse:
            return True
        if new == 1:
            return layer in self.groups
        return layer in self.ivf and (past == 0 or self.ivf[layer][0] is not None)

    def _stream(self, layer: int, a: dict[str, Any], new: int, past: int) -> None:
        """Streamed prefill around the model's own indexer: acquire the layer's prefix (issuing the next
        layer's copy) and have the layer's cache return prefix + new keys from the streamed buffer."""
        if layer == min(self.indexers):  # the first indexer layer of this forward
            if past == 0:
                self.streamer.reset()
            unused = set() if self.measure_recall else {i for i in self.indexers if self._replaces(i, new, past)}
            self.streamer.begin_chunk(skip=unused)
        self.streamer.acquire(layer)
        cache = _indexer_cache(a)
        if cache is None:
            raise DsaIndexError("Streamed prefill needs the model's cache (use_cache=True).",
                                "generate with the cache on, or load the runtime with stream_prefix=False.")
        skipped = not self.streamer.reads(layer)
        streamer = self.streamer

        def update_indexer(keys: torch.Tensor) -> torch.Tensor:
            full = streamer.extend(layer, keys[0])
            if skipped:  # the runtime selects for this layer: its exact scores are unused, read no prefix
                return keys[:, :1].new_zeros(1, 1, keys.shape[2]).expand(1, full.shape[0], keys.shape[2])
            return full.unsqueeze(0)

        cache.layers[layer].update_indexer = update_indexer

    def _before(self, layer: int) -> PreHook:
        def hook(mod: torch.nn.Module, a: dict[str, Any]) -> None:
            hidden = a["hidden_states"]
            rows, new = hidden.shape[0], hidden.shape[1]
            if rows > self.slots:
                raise ArtifactMismatchError(f"A batch of {rows} requests reached a runtime sized for {self.slots}.",
                                            "load the runtime with slots >= the server's batch size.")
            past = self._past(a, new)
            self._past_rows = past
            if self.side is not None:
                if layer == min(self.indexers):  # a new forward: every selection of the last one is joined
                    main = torch.cuda.current_stream(self.device)
                    for done in self._done.values():
                        main.wait_event(done)
                    self._done.clear()
                if layer in self.forked:
                    self._fork(a)
            if self.streamer is not None:
                self._stream(layer, a, new, past[0])
            if layer in self.reuse or (layer not in self.groups and layer not in self.ivf):
                return  # a reusing layer selects nothing of its own
            for slot in range(rows):
                if past[slot] == 0:
                    self._start(layer, slot)
            prefill = new > 1
            if not prefill and layer in self.ivf:  # decoding: the prefill index and its keys leave the device
                for slot in range(rows):
                    self.ivf[layer][slot] = None
            # a prefill chunk after decoding began (no index left) keeps the model's own selection
            routed = prefill and layer in self.ivf and all(self.ivf[layer][slot] is not None for slot in range(rows))
            cos, sin = a["position_embeddings"]
            query_rows = None if routed else torch.tensor([new - 1], device=hidden.device)
            with torch.no_grad():
                keys, queries, weights = mla_indexer_tensors(mod, self.geometry.rope_layout, hidden, a["q_resid"],
                                                             cos, sin, query_rows)
            self._fresh[layer] = keys
            keys = to_basis(keys.float(), self.basis)
            if routed and self.ivf_streamer is not None:
                self._lend_ivf_keys(layer, past[0])
            for slot in range(rows):
                if layer in self.groups:
                    self.groups[layer].append(slot, keys[slot])
                if layer in self.ivf and self.ivf[layer][slot] is not None:
                    self.ivf[layer][slot].append(keys[slot].to(self.device))
            positions = torch.stack([torch.arange(p, p + new, device=self.device) for p in past])  # [B, S]
            if routed:
                picked = [self.ivf[layer][slot].select(to_basis(queries[slot].float(), self.basis).to(self.device),
                                                       weights[slot].to(self.device), positions[slot])
                          for slot in range(rows)]
                self._chosen[layer] = ("prefill", torch.stack(picked), positions)
                if layer == max(self.ivf):  # every prefill index has taken the chunk's keys
                    self._note_prefill_bytes(layer, rows)
                if self.ivf_streamer is not None:  # the chunk's new key bytes go back to the host
                    index = self.ivf[layer][0].index
                    self.ivf_streamer.commit(layer, index.length)
                    index.detach()
                    self.ivf_streamer.release(layer)
            elif not prefill and layer in self.groups:
                picked, _ = self.groups[layer].select(to_basis(queries[:, -1].float(), self.basis), weights[:, -1])
                self._chosen[layer] = ("decode", picked[:rows].unsqueeze(1), positions)

        return hook

    def _skip(self, layer: int) -> SkipHook:
        """In place of the model's own indexer forward when the runtime selects for ``layer`` in this call
        and nothing reads the model's choice (no ``measure_recall``): the model's key cache takes the new
        keys (the pre-hook computed them) and no exact score is computed. (The model's own forward scores
        every query against every key, [B, S, H, T] in fp32: 16 GiB for a 1K-token chunk at 64K keys with
        V3.2's 64 heads.) The placeholder it returns, every key position up to the top-k, is the model's
        own choice where a query has at most top-k keys, and :meth:`_after` replaces it otherwise."""

        def skip(mod: torch.nn.Module, a: dict[str, Any]) -> torch.Tensor | None:
            keys = self._fresh.pop(layer, None)
            if keys is None or self.measure_recall or layer not in self._chosen:
                return None
            hidden = a["hidden_states"]
            rows, new = hidden.shape[0], hidden.shape[1]
            cache = _indexer_cache(a)
            if cache is not None:
                total = cache.update_indexer(keys.to(mod.wk.weight.dtype), mod.layer_idx).shape[1]
            else:
                total = self._past_rows[0] + new
            width = min(int(mod.index_topk), int(total))
            return torch.arange(width, device=hidden.device, dtype=torch.int32).expand(rows, new, width)

        return skip

    def _lend_ivf_keys(self, layer: int, past: int) -> None:
        """Streamed IVF keys: the layer's index borrows its streamed buffer (prefix loaded, the next IVF
        layer's load issued) for this chunk; the first IVF layer of a chunk opens it."""
        if layer == min(self.ivf):
            if past == 0:
                self.ivf_streamer.reset()
            self.ivf_streamer.begin_chunk()
        self.ivf_streamer.acquire(layer)
        self.ivf[layer][0].index.attach(self.ivf_streamer.buffer(layer))

    def _note_prefill_bytes(self, layer: int, rows: int) -> None:
        """Update the log's peak of prefill index bytes once per chunk, after the last prefill layer
        selected: every layer's index as it is now, plus that layer's dequantized prefix of the selection
        just made. (Indexes only grow within a prefill and every layer's prefix has the same length, so
        no earlier moment of the chunk holds more.)"""
        live = [ix.index for indexers in self.ivf.values() for ix in indexers if ix is not None]
        held = sum(sum(ix.device_bytes().values()) for ix in live)
        if self.ivf_streamer is not None:  # every layer's key bytes pass through its two buffers
            held += self.ivf_streamer.device_bytes()
        transient = sum(ix.index.length * ix.index.dim * 4 for ix in self.ivf[layer][:rows]
                        if ix is not None and ix.index.key_storage != "float32")
        if held + transient > self.log.prefill_index_peak:
            self.log.prefill_index_peak = held + transient
            self.log.prefill_index_keys = sum(ix.length for ix in live)

    def memory(self) -> dict[str, int]:
        """Device bytes of the runtime's own state: ``prefill_index_peak`` and ``prefill_index_keys``
        (:class:`ServingLog`), ``decode_state`` (every decode group: PQ codes sized for ``max_keys`` per
        slot, the caches and tails)."""
        decode = sum(sum(g.gpu_bytes().values()) * g.slots for g in self.groups.values())
        return {"prefill_index_peak": self.log.prefill_index_peak, "prefill_index_keys": self.log.prefill_index_keys,
                "decode_state": decode}

    def _after(self, layer: int) -> PostHook:
        def hook(mod: torch.nn.Module, output: torch.Tensor) -> torch.Tensor | None:
            if self.streamer is not None:
                self.streamer.release(layer)
            source = self.attend.get(layer, layer)
            if layer in self.reuse:  # no selection of its own
                return self._reused(layer, source, output)
            result = self._replacement(layer, output)
            own = output if result is None else result
            if self._main is not None:  # this layer's selection ran on the side stream: back to the main one
                own = self._join(layer, own)
            if source != layer:  # a kept layer under the lag attends an earlier kept layer's selection
                lagged = self._reused(layer, source, output)
                if lagged is None and layer in self._done:  # it attends its own after all: wait for it
                    torch.cuda.current_stream(self.device).wait_event(self._done[layer])
                result = result if lagged is None else lagged
            if layer in self._sources:  # later layers take this selection
                self._last[layer] = own
            return result

        return hook

    def _fork(self, a: dict[str, Any]) -> None:
        """Make the side stream current for this layer's selection, after the main stream's work so far (the
        layer's inputs); the inputs are marked as read there."""
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        for value in a.values():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(self.side)
        self._main = main
        torch.cuda.set_stream(self.side)

    def _join(self, layer: int, own: torch.Tensor) -> torch.Tensor:
        """Back to the main stream after ``layer``'s selection was queued on the side stream; later layers
        wait for the event recorded here before they attend it."""
        done = torch.cuda.Event()
        done.record(self.side)
        self._done[layer] = done
        own.record_stream(self._main)
        torch.cuda.set_stream(self._main)
        if self.measure_recall:  # the log compares the layer's own choice on the main stream now
            self._main.wait_event(done)
        self._main = None
        return own

    def _reused(self, layer: int, source: int, output: torch.Tensor) -> torch.Tensor | None:
        """The selection of the kept layer ``source`` in place of ``layer``'s own (IndexCache reuse)."""
        if source in self._done:  # queued on the side stream: the main stream waits for it here
            torch.cuda.current_stream(self.device).wait_event(self._done[source])
        chosen = self._last.get(source)
        if chosen is None or chosen.shape != output.shape:
            return None
        rows, new = output.shape[0], output.shape[1]
        kept = None
        if self.measure_recall:  # how much of this layer's own choice the reused one keeps
            own = output.reshape(rows * new, -1).long()
            starts = torch.tensor(self._past_rows[:rows], device=own.device).repeat_interleave(new)
            positions = torch.arange(new, device=own.device).repeat(rows) + starts
            own = own.masked_fill(own > positions[:, None], -1)
            reused = chosen.reshape(rows * new, -1).long()
            kept = _kept_share(reused.masked_fill(reused > positions[:, None], -1), own)
        self.log.add("prefill" if new > 1 else "decode", layer, rows * new, kept)
        return chosen

    def _replacement(self, layer: int, output: torch.Tensor) -> torch.Tensor | None:
        """The runtime's selection for ``layer`` in the form of the indexer's output, or None (the model's)."""
        chosen = self._chosen.pop(layer, None)
        if chosen is None:
            return None
        phase, picked, positions = chosen  # [B, S, topk] key positions (-1 = none), [B, S] query positions
        if output.shape[-1] < picked.shape[-1]:
            return None  # fewer keys than top-k: the model's own selection already takes every key
        rows, new = picked.shape[0], picked.shape[1]
        flat = picked.reshape(rows * new, -1)
        kept = None
        if self.measure_recall:  # the model's own choice, without the future keys it pads with
            own = output.reshape(rows * new, -1).to(picked.device).long()
            own = own.masked_fill(own > positions.reshape(-1, 1), -1)
            kept = _kept_share(flat, own)
        self.log.add(phase, layer, rows * new, kept)
        # -1 (fewer keys than k before this query) repeats the row's best position: the same mask
        filled = torch.where(flat >= 0, flat, flat[:, :1].clamp_min(0))
        return filled.view(rows, new, -1).to(output.device, torch.int32)


def _ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'``."""
    out, start = [], None
    for i, layer in enumerate(sorted(layers)):
        if start is None:
            start = layer
        nxt = sorted(layers)[i + 1] if i + 1 < len(layers) else None
        if nxt != layer + 1:
            out.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(out)


def serve_index(uris: str | Path | list[str | Path], model: torch.nn.Module, settings: ServeSettings | None = None,
                name: str | None = None, device: str | None = None, served: Any = None) -> ServedIndex:
    """Resolve, verify and validate artifact bundles against ``model``; the :class:`ServedIndex` that
    serves it (not yet attached: use it as a context manager, or call ``attach()``).

    uris : one bundle or several (paths or ``models:/<name>@<alias>``), e.g. a ``pq`` bundle for decode
    and an ``ivf`` bundle for prefill; a layer may have one artifact of each role (the kinds registry's
    ``role``: decode, prefill, or a model-level reuse plan). settings : :class:`ServeSettings`;
    ``decode.candidates="auto"`` gives each decode layer the smallest C whose held-out recall, as its
    bundle records it for the served stage 1, reaches ``decode.recall_target``
    (:func:`candidates_for_recall`); with ``decode.prefilter="auto"`` too, each layer's stage-1 factor is
    chosen with its C (:func:`dsaindex.runtime.loader.selection_for_recall`). name : the model's name in
    the fingerprint; served : the served model's fingerprint (default: computed from ``model``;
    ``settings.allow_other_weights`` skips the weights check, see
    :func:`dsaindex.runtime.loader.load_bundle`). Raises :class:`ArtifactMismatchError` (another model, a
    layer given twice, a kind serving does not use), :class:`dsaindex.errors.CorruptBundleError`,
    :class:`DsaIndexError` (no C reaches the recall target).
    """
    from dsaindex.artifacts.fingerprint import fingerprint_model
    from dsaindex.artifacts.kinds import ReusePlans
    from dsaindex.runtime.loader import load_bundle

    settings = settings or ServeSettings()
    dev = str(device or next(model.parameters()).device)
    if settings.allow_other_weights:
        served = None
    elif served is None:
        served = fingerprint_model(model, name or type(model).__name__)
    by_role: dict[str, dict[int, Any]] = {"decode": {}, "prefill": {}}
    metrics: dict[str, float] = {}  # the decode bundles' recorded recall, for the startup line
    budgets: list[int] = []  # each ivf bundle's smallest budget at the prefill recall target
    bundles: dict[str, str] = {}
    reuse: dict[int, int] | None = None
    chosen: dict[int, int] = {}
    factors: dict[int, int] = {}
    stages: dict[int, str] = {}
    # stage 1 by the fold scan where the device runs it (the torch path elsewhere: CPU serving, tests)
    folds = fold_scan_unavailable(dev, settings.use_triton) if settings.decode.stage1 != "codes" else None
    topk = geometry_from_config(model.config).topk
    for uri in [uris] if isinstance(uris, str | Path) else list(uris):
        loaded = load_bundle(uri, model.config, device=dev, basis=settings.basis, served=served,
                             tracking_uri=settings.tracking_uri, allow_other_weights=settings.allow_other_weights)
        bundles[str(uri)] = loaded.manifest.bundle_id
        for layer, obj in loaded.layers.items():
            role = loaded.kind_of(layer).role
            if role == "model":
                if not isinstance(obj, ReusePlans):
                    continue  # a layer that points at the layer holding the plans
                if reuse is not None:
                    raise ArtifactMismatchError(f"Two reuse bundles (the second {uri}).", "pass one reuse bundle.")
                if settings.retention is None:
                    raise DsaIndexError(f"{uri} holds cross-layer reuse plans; no retention was chosen.",
                                        "pass retention='1/N' (one of the bundle's plans).")
                plan = obj.plan(settings.retention, settings.reuse_method)
                reuse = dict(zip(obj.layers, plan.sources, strict=True))
                continue
            target = by_role.get(role)
            if target is None:
                raise ArtifactMismatchError(f"{uri} layer {layer} is a {loaded.manifest.layers[str(layer)].kind} "
                                            f"artifact (role {role}), which serving does not use.",
                                            "serve pq (decode) and ivf (prefill) bundles.")
            if layer in target:
                raise ArtifactMismatchError(f"Layer {layer} has two {role} artifacts (the second from {uri}).",
                                            "pass one bundle per kind.")
            target[layer] = obj
        if settings.decode.auto:  # the chooser `runtime check` and the engine plugins use too
            c_layers, p_layers, s_layers = decode_settings(settings.decode, loaded, topk, folds=folds)
            chosen.update(c_layers)
            factors.update(p_layers)
            stages.update(s_layers)
        if any(loaded.kind_of(layer).role == "decode" for layer in loaded.layers):
            metrics.update(loaded.manifest.metrics)
        if settings.prefill.ivf_budget is None and any(loaded.kind_of(layer).role == "prefill"
                                                         for layer in loaded.layers):
            budget = ivf_budget_for_recall(loaded.manifest.metrics, settings.prefill.ivf_recall_target, str(uri))
            if budget is not None:
                budgets.append(budget)
    if settings.decode.auto:
        decode = settings.decode
        settings = replace(settings, decode=replace(
            decode, candidates=chosen if decode.candidates == "auto" else decode.candidates,
            prefilter=factors if decode.prefilter == "auto" else decode.prefilter,
            stage1=stages if stages else decode.stage1))
    if budgets:  # the largest, so that every prefill layer reaches the target
        settings = replace(settings, prefill=replace(settings.prefill, ivf_budget=max(budgets)))
    index = ServedIndex(model, by_role["decode"], by_role["prefill"], settings, reuse=reuse, device=dev)
    index.bundles = bundles
    if index.candidates:
        grow = {}  # C grown past the band each layer's recall was measured in (every candidate rescored there)
        if settings.decode.long_prefix == "grow":
            bands = growth_bands(metrics, index.candidates, index.prefilter, topk, index.stage1)
            grow = {layer: index.groups[layer].grow_past(band) for layer, band in bands.items() if layer in index.groups}
        index.points = describe_points(metrics, index.candidates, index.prefilter, topk, settings.decode.recall_target,
                                       code_bytes={layer: code_bytes_of(codec) for layer, codec in by_role["decode"].items()},
                                       grow=grow, stage1=index.stage1)
        grown = [layer for layer, (_, most) in grow.items() if most > 1]
        if grown and index.slots > settings.decode.direct_upto:
            rows = max(index.groups[layer].cache_capacity for layer in grown)
            mib = max(index.groups[layer].gpu_bytes()["cache"] for layer in grown) / 2**20
            index.points += (f"; a step of more than {settings.decode.direct_upto} requests whose longest is past "
                             f"its band rescores every grown candidate (no miss filter), through a device cache "
                             f"sized for the growth ({rows:,} rows, {mib:.1f} MiB a request and layer; "
                             "--long-prefix fixed keeps C and its cache, at the recall given up)")
    return index
