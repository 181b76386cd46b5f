"""Hooks on the indexer modules of a transformers DSA model, for capture.

:class:`IndexerTap` is a :class:`dsaindex.hooks.ModuleHooks` set (handles kept and removed on exit; its
``enabled`` switch turns recording off without detaching). Per forward call and indexer layer it emits an
:class:`IndexerRecord` with the keys the module scores (new ones only), and queries and head weights at
the rows the caller asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dsaindex.geometry import IndexerGeometry
from dsaindex.hooks import ModuleHooks, PostHook, PreHook
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


class IndexerTap(ModuleHooks):
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
        super().__init__()
        self.geometry = geometry
        self.on_record = on_record
        self.query_rows: torch.Tensor | None = None
        self.keep_selected = False
        self._entries_seen: dict[int, int] = {}
        self._pending: dict[int, IndexerRecord] = {}
        self.indexers = find_indexers(model, geometry)

    def attach(self) -> None:
        for layer, module in self.indexers.items():
            if self.geometry.family == "deepseek_v4":
                self.register(module.scorer, pre=self._v4_scorer_hook(layer))
            else:
                self.register(module, pre=self._mla_hook(layer))
            self.register(module, post=self._output_hook(layer))

    def new_sequence(self) -> None:
        self._entries_seen.clear()
        self._pending.clear()

    def _rows(self, device: torch.device) -> torch.Tensor | None:
        return None if self.query_rows is None else self.query_rows.to(device)

    def _mla_hook(self, layer: int) -> PreHook:
        def hook(module: torch.nn.Module, a: dict[str, Any]) -> None:
            cos, sin = a["position_embeddings"]
            rows = self._rows(a["hidden_states"].device)
            with torch.no_grad():
                keys, queries, weights = mla_indexer_tensors(
                    module, self.geometry.rope_layout, a["hidden_states"], a["q_resid"], cos, sin, rows
                )
            self._pending[layer] = IndexerRecord(layer, keys, queries, weights)

        return hook

    def _v4_scorer_hook(self, layer: int) -> PreHook:
        def hook(module: torch.nn.Module, a: dict[str, Any]) -> None:
            rows = self._rows(a["hidden_states"].device)
            with torch.no_grad():
                keys, queries, weights = v4_scorer_tensors(
                    module, a["q"], a["compressed_kv"], a["hidden_states"], rows
                )
            seen = self._entries_seen.get(layer, 0)
            self._entries_seen[layer] = keys.shape[1]
            self._pending[layer] = IndexerRecord(layer, keys[:, seen:], queries, weights)

        return hook

    def _output_hook(self, layer: int) -> PostHook:
        def hook(module: torch.nn.Module, output: Any) -> None:
            record = self._pending.pop(layer, None)
            if record is None:
                return
            if self.keep_selected:
                record.selected = output.detach()
            self.on_record(record)

        return hook
