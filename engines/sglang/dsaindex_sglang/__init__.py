"""SGLang plugin: serve DeepSeek Sparse Attention decode selection from dsaindex PQ artifacts.

SGLang (0.5.23) calls :func:`register` at startup in every process (``sglang.srt.plugins.load_plugins``
scans the entry-point group ``sglang.srt.plugins``; ``SGLANG_PLUGINS=dsaindex`` restricts loading to this
one). With ``DSAINDEX_ARTIFACTS`` and ``DSAINDEX_CAPTURE`` unset it does nothing. With the artifacts it registers
these hooks in SGLang's ``HookRegistry`` (applied by ``load_plugins`` right after the plugins ran):

* after ``ModelConfig.__init__``: load the bundle (local path or ``models:/NAME@alias``), verify it and
  validate it against the served model's config (:func:`dsaindex.runtime.load_bundle`, the runtime check).
  A bundle of another model raises :class:`dsaindex.errors.ArtifactMismatchError` and startup fails with
  its message;
* around ``Indexer._get_topk_paged`` (the decode-time top-k of the DSA indexer): for layers with a PQ
  artifact, the selection is PQ coarse-to-fine over codes of SGLang's paged index-K cache pages,
  reranked exactly from the FP8 pages (:class:`dsaindex.runtime.paged_select.PagedCacheSelector`); it
  runs inside SGLang's decode CUDA graphs. Other layers and other forward modes keep SGLang's own path;
* after ``Indexer._get_topk_ragged`` (the eager prefill top-k): the prompt's completed pages are
  encoded, so the decode graphs find their codes ready;
* after ``DecodeTransferQueue.pop_transferred`` (a PD-disaggregated decode node): the pages a KV
  transfer delivered are encoded when their requests arrive, not by the decode steps' catch-up;
* with ``DSAINDEX_KEYS=host``, around SGLang's pool sizing and index-K allocation: the served layers'
  exact index keys live in pinned host memory the GPU reads in place, and the KV pool counts the codes'
  bytes per token for them instead of the keys', so it admits more tokens.

With ``DSAINDEX_CAPTURE`` (with or without artifacts) the engine capture's hooks
(:mod:`dsaindex_sglang.capture`): the finished requests' index keys and a sample of their decode queries
go to a capture store while SGLang serves.

Settings (environment): the ``DSAINDEX_*`` variables of :data:`dsaindex.runtime.settings.ENVIRONMENT`, the one
table both engine plugins read (defaults and meanings in the README, generated from it).
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"

logger = logging.getLogger("dsaindex_sglang")

# What the plugin hooks in SGLang 0.5.23 (dotted paths HookRegistry resolves)
SELECT_TARGET = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer._get_topk_paged"
CONFIG_TARGET = "sglang.srt.configs.model_config.ModelConfig.__init__"
PREFILL_TARGET = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer._get_topk_ragged"
TRANSFER_TARGET = "sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred"
# DSAINDEX_KEYS=host: the pool sizing and the index-K buffers of the served layers
CELL_TARGET = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_dsa_indexer_cell_size"
PAGES_TARGET = "sglang.srt.mem_cache.index_key_cache.IndexKeyCache._layer_num_pages"
KEYS_TARGET = "sglang.srt.mem_cache.index_key_cache.IndexKeyCache.__init__"
# DSAINDEX_CAPTURE: where a decode step's rows are named, and where a finished request's pages are still held
FORWARD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
RELEASE_TARGET = "sglang.srt.mem_cache.common.release_kv_cache"

_registered = False
_targets: set[str] = set()


def register() -> None:
    """SGLang's entry point (group ``sglang.srt.plugins``, name ``dsaindex``)."""
    global _registered
    from dsaindex.runtime.settings import engine_settings

    settings = engine_settings("sglang")
    if not settings.artifacts and not settings.capture:
        logger.info("dsaindex: neither DSAINDEX_ARTIFACTS nor DSAINDEX_CAPTURE is set; SGLang's own DSA selection "
                    "is left as it is.")
        return
    if _registered:
        return
    from dsaindex_sglang import hooks

    if settings.artifacts:
        hooks.STATE.configure(settings.artifacts)
        _hook(CONFIG_TARGET, hooks.validate_after_model_config, "AFTER")
        _hook(SELECT_TARGET, hooks.select_around_get_topk_paged, "AROUND")
        _hook(PREFILL_TARGET, hooks.encode_after_get_topk_ragged, "AFTER")
        _hook(TRANSFER_TARGET, hooks.encode_after_pop_transferred, "AFTER")
        _hook(CELL_TARGET, hooks.index_cell_size_around, "AROUND")
        _hook(PAGES_TARGET, hooks.index_pages_around, "AROUND")
        _hook(KEYS_TARGET, hooks.host_keys_after_init, "AFTER")
        logger.info("dsaindex: registered (artifacts %s); decode selection of layers with PQ artifacts is "
                    "the plugin's.", settings.artifacts)
    if settings.capture:
        register_capture(settings)
    _registered = True


def register_capture(settings=None) -> None:
    """The capture's hooks (``DSAINDEX_CAPTURE``; :mod:`dsaindex_sglang.capture`): the ModelConfig check, the
    decode queries staged in the selection's hook, the step's rows after ``ModelRunner.forward``, the finished
    request's pages before ``release_kv_cache``. Idempotent; a target the artifacts already hook is not
    hooked twice."""
    from dsaindex.runtime.settings import engine_settings
    from dsaindex_sglang import capture, hooks

    settings = settings or engine_settings("sglang")
    capture.CAPTURE.configure(settings)
    _hook(CONFIG_TARGET, hooks.validate_after_model_config, "AFTER")
    _hook(SELECT_TARGET, hooks.select_around_get_topk_paged, "AROUND")
    _hook(FORWARD_TARGET, capture.after_forward, "AFTER")
    _hook(RELEASE_TARGET, capture.before_release, "BEFORE")
    logger.info("dsaindex: capturing into %s (keys of finished requests, queries of %d decode steps each).",
                settings.capture, settings.capture_queries)


def _hook(target: str, hook, kind: str) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if target not in _targets:
        HookRegistry.register(target, hook, HookType[kind])
        _targets.add(target)
