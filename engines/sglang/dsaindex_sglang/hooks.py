"""The hooks :func:`dsaindex_sglang.register` installs, and the per-process plugin state."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

import dsaindex_sglang.capture as capture
from dsaindex_sglang.selection import LayerSelection, to_sglang_selection

logger = logging.getLogger("dsaindex_sglang")


class PluginState:
    """Per process: the bundle's URI and settings, then the loaded artifacts and one selector per layer."""

    def __init__(self) -> None:
        self.uri: str | None = None
        self.loaded = None  # dsaindex.runtime.loader.LoadedArtifacts
        self.selectors: dict[int, LayerSelection] = {}
        self.fallbacks: dict[str, int] = {}
        self.calls = 0
        self.rows: dict[str, int] = {}  # query rows served, by forward mode (decode, target_verify)
        self.topk = 2048  # the model's index_topk
        self.arrived_pages = 0  # pages encoded when a PD transfer delivered them
        self.keys = "device"  # DSAINDEX_KEYS: where the served layers' exact index keys live
        self.code_bytes = 0.0  # device bytes per key the selectors keep (codes, signatures, flags)
        self.host_key_bytes = 0  # bytes of index keys placed in host memory

    def configure(self, uri: str) -> None:
        self.uri = uri

    def load(self, hf_config: Any) -> None:
        """Load, verify and validate the bundle against ``hf_config`` (the served model's config):
        :func:`dsaindex.runtime.load_bundle`, the runtime check. Raises ArtifactMismatchError on a bundle of
        another model; SGLang's startup then fails with its message."""
        if self.loaded is not None:
            return
        from dsaindex.runtime.loader import (
            code_bytes_of,
            decode_settings,
            describe_points,
            growth_bands,
            load_bundle,
        )
        from dsaindex.runtime.paged_select import (
            check_paged_codes,
            describe_step,
            device_bytes_per_key,
            fold_scan_unavailable,
            growth_limit,
            stage1_scan,
        )
        from dsaindex.runtime.settings import engine_settings

        s = engine_settings("sglang")
        loaded = load_bundle(self.uri, hf_config, device="cpu", basis=s.basis, cache_dir=s.cache_dir,
                             tracking_uri=s.tracking_uri, allow_other_weights=s.allow_other_weights)
        check_paged_codes(loaded.layers)  # RQ layers: refused at startup, not at the first decode step
        topk = int(getattr(hf_config, "index_topk", 0) or 0) or 2048
        self.topk = topk
        # counts, or `auto`: each layer's C (and with DSAINDEX_PREFILTER=auto its stage 1) from the bundle's
        # held-out recall, refused here if none reaches the target
        # (and with DSAINDEX_STAGE1=auto what stage 1 scores: the fold scan where it runs on the serving GPU)
        import torch

        serving = "cuda" if torch.cuda.is_available() else "cpu"
        candidates, prefilter, stage1 = decode_settings(s.decode(topk), loaded, topk,
                                                        folds=fold_scan_unavailable(serving))
        # DSAINDEX_LONG_PREFIX=grow: C grows with a request's prefix past the band its recall was measured in
        bands = growth_bands(loaded.manifest.metrics, candidates, prefilter, topk,
                             stage1) if s.long_prefix == "grow" else {}
        self.selectors = {}
        for layer, codec in loaded.layers.items():
            if loaded.kind_of(layer).role != "decode":
                continue  # other roles (ivf prefill, ...) are not the plugin's; SGLang keeps its own path there
            self.selectors[layer] = LayerSelection(codec, candidates=candidates[layer], prefilter=prefilter[layer],
                                                   stage1=stage1[layer], keys_on_host=s.keys == "host", exact_below=s.exact_below,
                                                   grow_band=bands.get(layer, 0))
        self.keys = s.keys
        self.code_bytes = max((device_bytes_per_key(sel.codec.codebooks.shape[0]) for sel in self.selectors.values()),
                              default=0.0)
        self.loaded = loaded
        logger.info("dsaindex: artifacts %s validated for %s; PQ decode selection on layers %s (%s); "
                    "their exact index keys on the %s (DSAINDEX_KEYS=%s), %.1f B per key of codes on the GPU; %s.",
                    loaded.manifest.bundle_id, loaded.manifest.model.name, sorted(self.selectors),
                    describe_points(loaded.manifest.metrics, candidates, prefilter, topk, s.recall_target,
                                    code_bytes={layer: code_bytes_of(sel.codec) for layer, sel in self.selectors.items()},
                                    grow={layer: (sel.grow_band, growth_limit(max(sel.candidates, topk)))
                                          for layer, sel in self.selectors.items()}, stage1=stage1),
                    "host, read in place" if self.keys == "host" else "GPU, as without the plugin", self.keys,
                    self.code_bytes,
                    describe_step(0 if self.keys == "host" else s.exact_below,
                                  [max(candidates[layer], topk) * prefilter[layer] for layer in self.selectors],
                                  stage1_scan([sel.codec for sel in self.selectors.values()]),
                                  grows=any(sel.grow_band for sel in self.selectors.values()),
                                  folds="folds" in stage1.values()))

    def note_fallback(self, why: str) -> None:
        if why not in self.fallbacks:
            logger.warning("dsaindex: SGLang's own selection runs where %s.", why)
        self.fallbacks[why] = self.fallbacks.get(why, 0) + 1


STATE = PluginState()


def validate_after_model_config(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on ``ModelConfig.__init__``: validate and load the artifacts for the target model
    (draft models are not served by the artifacts); with ``DSAINDEX_CAPTURE``, check the capture store against
    the same config (:meth:`dsaindex_sglang.capture.CaptureState.prepare`)."""
    if getattr(self, "is_draft_model", False):
        return None
    config = checkpoint_config(self)
    if STATE.uri:
        STATE.load(config)
    if capture.CAPTURE.on:
        capture.CAPTURE.prepare(self, config)
    return None


def checkpoint_config(model_config: Any) -> Any:
    """The served checkpoint's config as transformers reads it from ``config.json`` (what a capture
    fingerprints). SGLang's ``hf_config`` carries runtime fields it adds itself (``context_len``,
    ``encoder_only``, ``swa_head_dim``, a ``type`` key in ``rope_parameters``, ...), so its digest is not
    the checkpoint's; it is used only where transformers cannot read the folder."""
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_config.model_path, revision=getattr(model_config, "revision", None))
    except Exception as err:  # noqa: BLE001 - remote code, an unknown model type, no local files
        logger.warning("dsaindex: validating against SGLang's hf_config (transformers could not read %s: %s).",
                       model_config.model_path, str(err).splitlines()[0] if str(err) else type(err).__name__)
        return model_config.hf_config


def select_around_get_topk_paged(original, self, forward_batch, layer_id, q_fp8, weights, metadata):
    """AROUND hook on ``Indexer._get_topk_paged`` (sglang/srt/layers/attention/dsa/dsa_indexer.py:1219).

    Serves plain decode (one query row per request) and MTP / speculative target verify (next_n query rows
    per request: SGLang's metadata then holds one page-table row and one length per query row,
    ``real_page_table`` repeated next_n times and ``dsa_seqlens_expanded`` = prefix + 1 ... prefix +
    next_n, dsa_backend.py:1168-1188 and :1683-1730; each row is selected as a request of its own length).

    Returns what the original returns: [rows, index_topk] int32, valid entries first and -1 after, padding
    rows all -1; page_size=1 KV slots when SGLang's fused top-k transform is on, logical key positions
    otherwise (see :func:`dsaindex_sglang.selection.to_sglang_selection`). Launch shapes depend on the batch
    and the page table's width only, and nothing synchronizes with the host while a CUDA graph is
    captured, so SGLang's decode and verify graphs capture it. With ``DSAINDEX_CAPTURE`` a decode step's
    queries, weights and lengths are staged for the capture first (every indexer layer)."""
    if capture.CAPTURE.on:
        capture.stage(forward_batch, layer_id, q_fp8, weights, metadata)
    layer = STATE.selectors.get(int(layer_id))
    if layer is None:
        return original(self, forward_batch, layer_id, q_fp8, weights, metadata)
    why, seqlens = query_rows(forward_batch, metadata, q_fp8)
    cache = None if why else _index_buffer(self, layer_id)
    if cache is None:
        STATE.note_fallback(why or "the index-K pages are not plain 64-key pages")
        return original(self, forward_batch, layer_id, q_fp8, weights, metadata)
    page_table = metadata.get_page_table_64()
    rows = seqlens.shape[0]
    w = weights.reshape(weights.shape[0], weights.shape[1])[:rows]
    selector = layer.over(cache, self.index_topk)
    positions = selector.select(cache, page_table, seqlens, q_fp8[:rows], w,
                                init_tokens=int(getattr(self, "num_init_tokens", 0) or 0),
                                local_tokens=int(getattr(self, "num_local_tokens", 0) or 0))
    STATE.calls += 1
    STATE.rows[_mode_name(forward_batch)] = STATE.rows.get(_mode_name(forward_batch), 0) + rows
    out = to_sglang_selection(positions, page_table, fused=_fused_topk(metadata))
    if q_fp8.shape[0] > rows:  # padding rows of the hidden states select nothing (as the original)
        pad = torch.full((q_fp8.shape[0] - rows, out.shape[1]), -1, dtype=out.dtype, device=out.device)
        out = torch.cat([out, pad])
    return out


def encode_after_get_topk_ragged(result, self, enable_dual_stream, forward_batch, layer_id, q_fp8, weights, metadata,
                                 *args, **kwargs):
    """AFTER hook on ``Indexer._get_topk_ragged`` (dsa_indexer.py:1479), SGLang's eager prefill top-k:
    the prompt's keys are in the index-K buffer by then, so the completed pages of the batch's requests
    are encoded here, outside the decode graphs. SGLang's own prefill selection is kept (None)."""
    layer = STATE.selectors.get(int(layer_id))
    cache = None if layer is None else _index_buffer(self, layer_id)
    if cache is None:
        return None
    page_table = metadata.get_page_table_64()
    seqlens = metadata.get_seqlens_int32()
    if page_table.shape[0] != seqlens.shape[0]:
        STATE.note_fallback("a prefill's page table and lengths disagree in rows (pages are encoded at decode)")
        return None
    layer.over(cache, self.index_topk).prepare(cache, page_table, seqlens)
    return None


def encode_after_pop_transferred(result, self, *args, **kwargs):
    """AFTER hook on ``DecodeTransferQueue.pop_transferred`` (sglang/srt/disaggregation/decode.py:2833), on a
    PD-disaggregated decode node: the requests it returns have their prompt's KV, index keys included,
    written into this node's pools by the transfer, and no prefill runs here. Their completed pages are
    encoded now, once (the same :meth:`PagedCacheSelector.prepare` the prefill hook runs), instead of 2
    pages a step by the decode graphs' catch-up while stage 1 ranks stale codes. Returns None (the
    original's result is kept)."""
    reqs = [r for r in (result or []) if _pool_index(r) is not None]
    if not reqs or not STATE.selectors:
        return None
    scheduler = self.scheduler
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    if getattr(pool, "index_page_size", None) != 64 or getattr(pool, "index_kpool", 1) != 1:
        STATE.note_fallback("a PD transfer's index-K pages are not plain 64-key pages (encoded at decode)")
        return None
    lengths = [len(r.origin_input_ids) for r in reqs]
    width = max(-(-n // 64) for n in lengths)
    if width == 0:
        return None
    tokens = scheduler.req_to_token_pool.req_to_token
    first = torch.arange(0, width * 64, 64, device=tokens.device)
    slots = tokens[torch.tensor([_pool_index(r) for r in reqs], device=tokens.device)][:, first]
    table = (slots.long() // 64).to(torch.int32)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=tokens.device)
    for layer_id, layer in STATE.selectors.items():
        cache = pool.get_index_k_with_scale_buffer(layer_id)
        STATE.arrived_pages += layer.over(cache, STATE.topk).prepare(cache, table.to(cache.device),
                                                                      seqlens.to(cache.device))
    return None


def _pool_index(req) -> int | None:
    """The request's ``req_to_token`` row: ``req.kv.req_pool_idx`` in SGLang 0.5.23 (``ReqKvInfo``,
    schedule_batch.py:955), ``req.req_pool_idx`` in the releases before it."""
    kv = getattr(req, "kv", None)
    return getattr(kv, "req_pool_idx", None) if kv is not None else getattr(req, "req_pool_idx", None)


# ---- DSAINDEX_KEYS=host: the served layers' exact index keys in pinned host memory -----------------------
KEY_BYTES = 128 + 128 // 128 * 4  # SGLang's index-K bytes per token and layer (pool_configurator.py:567-570)


def index_cell_size_around(original, self, *args, **kwargs):
    """AROUND hook on ``DefaultPoolConfigurator._compute_dsa_indexer_cell_size``
    (sglang/srt/model_executor/pool_configurator.py:560): the index-K bytes per token SGLang counts when it
    sizes its KV pool from the free HBM. With ``DSAINDEX_KEYS=host`` the served layers' keys are not on the
    GPU; the selectors' codes are, so each served layer counts their bytes instead of the keys' 132 and the
    pool admits more tokens. The draft model's sizing (fewer layers than the target's range) is left as is."""
    full = original(self, *args, **kwargs)
    if STATE.keys != "host" or not STATE.selectors:
        return full
    kvc = kwargs.get("kvc", args[0] if args else None)
    num_layers = kwargs.get("num_layers", args[1] if len(args) > 1 else None)
    info = getattr(kvc, "layer_info", None)
    if kvc is None or info is None or getattr(kvc, "is_draft_worker", False):
        return full
    start, end = int(info.start_layer), int(info.end_layer)
    if num_layers is not None and int(num_layers) != end - start:
        return full
    served = sum(start <= layer < end for layer in STATE.selectors)
    if served == 0 or full < served * KEY_BYTES:
        return full
    return int(math.ceil(full - served * (KEY_BYTES - STATE.code_bytes)))


def index_pages_around(original, self, layer_idx, num_pages):
    """AROUND hook on ``IndexKeyCache._layer_num_pages`` (sglang/srt/mem_cache/index_key_cache.py:56): with
    ``DSAINDEX_KEYS=host`` a served layer gets a 0-row device placeholder (as SGLang gives layers that write
    no index keys), so no HBM is taken for its keys; :func:`host_keys_after_init` gives it its buffer."""
    if STATE.keys == "host" and int(self.pool.start_layer) + int(layer_idx) in STATE.selectors:
        return 0
    return original(self, layer_idx, num_pages)


def host_keys_after_init(result, self, pool, index_buf_size, *args, **kwargs):
    """AFTER hook on ``IndexKeyCache.__init__`` (index_key_cache.py:22): each served layer's buffer, of the
    shape SGLang would have given it, in pinned host memory the GPU reads in place
    (:func:`dsaindex.runtime.mapped.host_mapped_zeros`): SGLang's own kernels write and read it there, and
    the selector rescores its C candidates from it."""
    if STATE.keys != "host" or not STATE.selectors:
        return None
    from dsaindex.runtime.mapped import host_mapped_zeros

    num_pages = (index_buf_size + pool.page_size + 1) // pool.page_size  # as IndexKeyCache.__init__ counts
    skip = getattr(pool, "skip_topk_layers", None)
    moved = []
    for i in range(pool.layer_num):
        layer = int(pool.start_layer) + i
        if layer not in STATE.selectors or (skip is not None and skip[i]) or self.buffer[i].shape[0]:
            continue
        self.buffer[i] = host_mapped_zeros(self._buffer_shape(num_pages), pool.index_k_with_scale_buffer_dtype,
                                           pool.device)
        STATE.host_key_bytes += self.buffer[i].numel() * self.buffer[i].element_size()
        moved.append(layer)
    logger.info("dsaindex: the exact index keys of layers %s are in pinned host memory (%.2f GB), read in place; "
                "the KV pool counted %.1f B of codes per token for each of them instead of %d B of keys.",
                moved, STATE.host_key_bytes / 1e9, STATE.code_bytes, KEY_BYTES)
    return None


def _index_buffer(indexer, layer_id) -> torch.Tensor | None:
    """The layer's index-K read buffer [pages, 64 * 132] uint8, or None where it is not plain 64-key pages."""
    from sglang.srt.layers.attention.dsa import dsa_indexer

    pool = dsa_indexer.get_token_to_kv_pool()
    if getattr(pool, "index_page_size", None) != 64 or getattr(pool, "index_kpool", 1) != 1:
        return None
    return indexer._get_index_k_read_buffer(pool, layer_id)


def _fused_topk(metadata) -> bool:
    """SGLang's switch (dsa_topk_backend.py:109): fused top-k emits page_size=1 KV slots."""
    from sglang.srt.environ import envs

    return bool(envs.SGLANG_DSA_FUSE_TOPK.get()) and not getattr(metadata, "force_unfused_topk", False)


def _mode_name(forward_batch) -> str:
    mode = forward_batch.forward_mode
    return "target_verify" if mode.is_target_verify() else "decode"


def query_rows(forward_batch, metadata, q_fp8) -> tuple[str | None, torch.Tensor | None]:
    """(why this call stays on SGLang's path, None) or (None, the keys visible to each query row [rows]
    int32): a plain decode step reads ``get_seqlens_int32()`` (one row per request), a target verify step
    ``get_seqlens_expanded()`` (one row per draft token), as ``_get_topk_paged`` itself does
    (dsa_indexer.py:1258-1264). The page table must then have one row per query row."""
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None:
        return "the forward mode is unknown", None
    if mode.is_decode():
        seqlens = metadata.get_seqlens_int32()
    elif mode.is_target_verify():
        seqlens = metadata.get_seqlens_expanded()
    else:
        return "the forward mode is not decode or target verify (draft extend / idle)", None
    method = getattr(metadata, "topk_transform_method", None)
    if method is not None and getattr(method, "name", "PAGED") != "PAGED":
        return f"the top-k transform is {method.name}", None
    if seqlens is None or seqlens.dim() != 1:
        return "the step's lengths are not one per query row", None
    rows = seqlens.shape[0]
    if q_fp8.shape[0] < rows or metadata.get_page_table_64().shape[0] != rows:
        return "the page table does not have one row per query row", None
    return None, seqlens
