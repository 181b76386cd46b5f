"""The entry point vLLM's plugin loader calls in every process (``vllm.general_plugins``, name ``dsaindex``).

vLLM (``vllm/plugins/__init__.py``, ``load_general_plugins``) loads the group's entry points named in
``VLLM_PLUGINS`` (all of them when unset) and calls each; a process may call it more than once, so
:func:`register` is idempotent.

Environment: the ``DSAINDEX_*`` variables of :data:`dsaindex.runtime.settings.ENVIRONMENT`, the one table both
engine plugins read (its defaults and meanings are in the README, generated from it). With
``DSAINDEX_ARTIFACTS`` and ``DSAINDEX_CAPTURE`` unset or empty the plugin does nothing and vLLM keeps its own
indexer; with ``DSAINDEX_CAPTURE`` alone the op is replaced too, every layer runs vLLM's own indexer, and the
capture (:mod:`dsaindex_vllm.capture`) records what it serves.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("dsaindex_vllm")


def register() -> None:
    """Register the out-of-tree ``SparseAttnIndexer`` when ``DSAINDEX_ARTIFACTS`` or ``DSAINDEX_CAPTURE`` is set.

    The artifacts are resolved, verified and checked against the served model when vLLM builds the
    model's first indexer layer (the model config is known only then), so a bundle of another model
    stops startup with :class:`dsaindex.errors.ArtifactMismatchError` before anything is served.
    """
    from dsaindex.runtime.settings import engine_settings

    settings = engine_settings("vllm")
    if not settings.artifacts and not settings.capture:
        logger.debug("DSAINDEX_ARTIFACTS and DSAINDEX_CAPTURE are unset: dsaindex leaves vLLM's sparse attention "
                     "indexer as it is.")
        return
    from dsaindex_vllm.op import install

    install()
    if settings.artifacts:
        logger.info("dsaindex: vLLM's SparseAttnIndexer replaced; artifacts %s load with the model.",
                    settings.artifacts)
    if settings.capture:
        logger.info("dsaindex: capturing into %s once the model's indexer layers are built (keys of finished "
                    "requests, queries of %d decode steps each).", settings.capture, settings.capture_queries)
