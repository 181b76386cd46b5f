"""vLLM plugin for dsaindex: decode-time top-k of DeepSeek Sparse Attention layers from trained PQ artifacts.

Installed as the ``dsaindex`` entry point of vLLM's ``vllm.general_plugins`` group; see
:func:`dsaindex_vllm.plugin.register`. ``selection`` holds the engine-independent part (paged PQ codes
beside the engine's index-K cache and the coarse-to-fine selection), ``op`` the replacement of vLLM's
``SparseAttnIndexer`` layer.
"""

__version__ = "0.1.0"
