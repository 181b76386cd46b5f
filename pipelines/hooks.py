"""Hooks on the indexer modules of a transformers DSA model.

:class:`IndexerTap` is the one place hooks are attached: it keeps every handle, removes them all on
exit, and has a switch (``enabled``) that turns recording off without detaching. Per forward call and
indexer layer it emits an :class:`IndexerRecord` with the keys the module scores (new ones only), and
queries and head weights at the rows the caller asked for.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsaindex.geometry import IndexerGeometry
from dsaindex.indexer import find_indexers, mla_indexer_tensors, v4_scorer_tensors


@dataclass
class IndexerRecord:
    """What one indexer layer scored in one forward call (batch dim first).

    keys : [B, T_new, D] float32, keys that became scorable in this call (tokens, or V4 entries)
    queries : [B, s, H, D] float32 at the requested rows; head_weights : [B, s, H] float32 (effective)
    selected : the module's own output (top-k indices or mask), for tests
    """

    layer: int
    keys: torch.Tensor
    queries: torch.Tensor
    head_weights: torch.Tensor
    selected: torch.Tensor | None = None


def _bind(fn: Callable, args: tuple, kwargs: dict) -> dict:
    bound = inspect.signature(fn).bind_partial(*args, **kwargs)
    return dict(bound.arguments)


class IndexerTap:
    """Records what each indexer layer scores while a model runs.

    Parameters
    ----------
    model : a transformers ``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM`` / ``DeepseekV4ForCausalLM``
    geometry : its :class:`IndexerGeometry`
    on_record : called with each :class:`IndexerRecord`

    Set ``query_rows`` (indices into the current forward call's tokens) before a call to record
    queries only there; ``None`` records all rows. Call :meth:`new_sequence` between sequences (V4
    emits compressed entries cumulatively; the tap keeps how many it already reported).
    """

    def __init__(self, model: torch.nn.Module, geometry: IndexerGeometry, on_record: Callable[[IndexerRecord], None]):
        self.geometry = geometry
        self.on_record = on_record
        self.enabled = True
        self.query_rows: torch.Tensor | None = None
        self.keep_selected = False
        self._handles: list = []
        self._entries_seen: dict[int, int] = {}
        self._pending: dict[int, IndexerRecord] = {}
        self.indexers = find_indexers(model, geometry)

    def __enter__(self) -> IndexerTap:
        for layer, module in self.indexers.items():
            if self.geometry.family == "deepseek_v4":
                self._handles.append(
                    module.scorer.register_forward_pre_hook(self._v4_scorer_hook(layer), with_kwargs=True)
                )
            else:
                self._handles.append(module.register_forward_pre_hook(self._mla_hook(layer), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._output_hook(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def new_sequence(self) -> None:
        self._entries_seen.clear()
        self._pending.clear()

    def _rows(self, device: torch.device) -> torch.Tensor | None:
        return None if self.query_rows is None else self.query_rows.to(device)

    def _mla_hook(self, layer: int):
        def hook(module, args, kwargs):
            if not self.enabled:
                return None
            a = _bind(module.forward, args, kwargs)
            cos, sin = a["position_embeddings"]
            rows = self._rows(a["hidden_states"].device)
            with torch.no_grad():
                keys, queries, weights = mla_indexer_tensors(
                    module, self.geometry.rope_layout, a["hidden_states"], a["q_resid"], cos, sin, rows
                )
            self._pending[layer] = IndexerRecord(layer, keys, queries, weights)
            return None

        return hook

    def _v4_scorer_hook(self, layer: int):
        def hook(module, args, kwargs):
            if not self.enabled:
                return None
            a = _bind(module.forward, args, kwargs)
            rows = self._rows(a["hidden_states"].device)
            with torch.no_grad():
                keys, queries, weights = v4_scorer_tensors(
                    module, a["q"], a["compressed_kv"], a["hidden_states"], rows
                )
            seen = self._entries_seen.get(layer, 0)
            self._entries_seen[layer] = keys.shape[1]
            self._pending[layer] = IndexerRecord(layer, keys[:, seen:], queries, weights)
            return None

        return hook

    def _output_hook(self, layer: int):
        def hook(module, args, output):
            record = self._pending.pop(layer, None)
            if record is None or not self.enabled:
                return None
            if self.keep_selected:
                record.selected = output.detach()
            self.on_record(record)
            return None

        return hook
