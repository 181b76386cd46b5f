"""The entry point vLLM's plugin loader calls in every process (``vllm.general_plugins``, name ``dsaindex``).

vLLM (``vllm/plugins/__init__.py``, ``load_general_plugins``) loads the group's entry points named in
``VLLM_PLUGINS`` (all of them when unset) and calls each; a process may call it more than once, so
:func:`register` is idempotent.

Environment:

* ``DSAINDEX_ARTIFACTS``: a bundle path or ``models:/<name>@<alias>`` (``/<version>``). Unset or empty:
  the plugin does nothing and vLLM keeps its own indexer.
* ``DSAINDEX_BASIS`` (default ``raw``): the key basis the engine's index-K cache holds. vLLM 0.33's
  DeepSeek-V3.2 indexer stores LayerNorm + RoPE keys without a Hadamard rotation, so ``raw``.
* ``DSAINDEX_CANDIDATES`` (default ``2 * index_topk``): keys reranked exactly per decode query;
  ``DSAINDEX_PREFILTER`` (default 4): the folded first stage keeps ``PREFILTER * CANDIDATES``; ``auto``
  (with ``DSAINDEX_CANDIDATES=auto``): each layer's factor chosen with its C.
* ``DSAINDEX_ALLOW_OTHER_WEIGHTS=1``: serve artifacts of another model of the same geometry.
* ``DSAINDEX_CACHE_DIR`` / ``MLFLOW_TRACKING_URI``: where ``models:/`` bundles are pulled from and to.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("dsaindex_vllm")

ENV_ARTIFACTS = "DSAINDEX_ARTIFACTS"


def register() -> None:
    """Register the out-of-tree ``SparseAttnIndexer`` when ``DSAINDEX_ARTIFACTS`` is set.

    The artifacts are resolved, verified and checked against the served model when vLLM builds the
    model's first indexer layer (the model config is known only then), so a bundle of another model
    stops startup with :class:`dsaindex.errors.ArtifactMismatchError` before anything is served.
    """
    uri = os.environ.get(ENV_ARTIFACTS, "").strip()
    if not uri:
        logger.debug("%s is unset: dsaindex leaves vLLM's sparse attention indexer as it is.", ENV_ARTIFACTS)
        return
    from dsaindex_vllm.op import install

    install()
    logger.info("dsaindex: vLLM's SparseAttnIndexer replaced; artifacts %s load with the model.", uri)
