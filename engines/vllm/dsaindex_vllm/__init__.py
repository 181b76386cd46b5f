"""vLLM plugin for dsaindex: decode-time top-k of DeepSeek Sparse Attention layers from trained PQ artifacts.

Installed as the ``dsaindex`` entry point of vLLM's ``vllm.general_plugins`` group; see
:func:`dsaindex_vllm.plugin.register`. ``op`` is the replacement of vLLM's ``SparseAttnIndexer`` layer;
the selection it runs (PQ codes beside the engine's paged index-K cache, coarse-to-fine, CUDA-graph safe)
is dsaindex's own :class:`dsaindex.runtime.paged_select.PagedCacheSelector`, shared with the SGLang plugin.
"""

__version__ = "0.1.0"
