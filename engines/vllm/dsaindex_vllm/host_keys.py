"""``DSAINDEX_KEYS=host`` in vLLM: the served layers' exact index keys in pinned host memory, their codes in
the bytes vLLM's KV pool would have given the keys.

vLLM sizes its KV pool from each attention layer's ``get_kv_cache_spec`` (``vllm/v1/core/kv_cache_planning.py``:
the blocks it allocates are the free HBM over the sum of the layers' page bytes) and hands every layer its
view of the pool through ``bind_kv_cache`` (``vllm/v1/worker/utils.py``, ``bind_kv_cache_to_layers``). For
an index-K cache (``DeepseekV32IndexerCache``, deepseek_v2.py; the CUDA path's ``models/deepseek_v32``
builds the same class) of a layer the plugin serves, the two are wrapped:

* ``get_kv_cache_spec`` reports a page of M bytes a key (the layer's PQ codes, M subspaces) instead of
  D + 4 = 132, so the pool counts the codes' bytes and admits more blocks at equal HBM;
* ``bind_kv_cache`` gives the layer's pool view, ``[num_blocks, 64, M]`` uint8, to the layer's selector as its
  codes (:class:`dsaindex.runtime.paged_select.PagedCacheSelector` ``codes=``) and binds the layer to a
  ``[num_blocks, 64, D + 4]`` buffer in pinned host memory the GPU reads and writes in place
  (:func:`dsaindex.runtime.mapped.host_mapped_zeros`): vLLM's own kernels write the keys there and read
  them for prefill, and each decode step reads its C candidates' keys over the host link.

Nothing else reads the layer's pool bytes as keys, except a KV connector (disaggregated prefill, offload),
which would move the codes for keys, and HiSparse, which lays the pool out itself: both are refused at
startup (:func:`refuse_unsupported`), as is a pool layout that does not keep a layer's pages in one run.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from dsaindex.errors import DsaIndexError

logger = logging.getLogger("dsaindex_vllm")

CODE_BYTES = "_dsaindex_code_bytes"  # on a served layer's index-K cache: M, its codes' bytes a key
CODES = "_dsaindex_codes"  # after binding: the pool's bytes for the layer, [num_blocks, 64, M] uint8
moved_bytes = 0  # host bytes of index keys placed by this process (logs, tests)


def refuse_unsupported(vllm_config: Any) -> None:
    """Stop startup (DsaIndexError naming the fix) where host-resident keys would serve wrong keys."""
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        raise DsaIndexError("DSAINDEX_KEYS=host with a KV connector (kv_transfer_config): the connector moves "
                            "the pool's bytes of each layer, which for the plugin's layers hold PQ codes, "
                            "not index keys.", "set DSAINDEX_KEYS=device on a server with a KV connector.")
    attention = getattr(vllm_config, "attention_config", None)
    if getattr(attention, "hisparse_config", None) is not None:
        raise DsaIndexError("DSAINDEX_KEYS=host with HiSparse: HiSparse lays out the sparse caches between "
                            "host and GPU itself.", "use one of them: unset DSAINDEX_KEYS or HiSparse.")


def mark(cache: Any, code_bytes: int) -> None:
    """Make ``cache`` (a served layer's ``DeepseekV32IndexerCache``) host-resident, its pool page counted at
    ``code_bytes`` a key. Called when the layer is built, before vLLM asks for the specs."""
    install()
    setattr(cache, CODE_BYTES, int(code_bytes))


def install() -> None:
    """Wrap ``DeepseekV32IndexerCache.get_kv_cache_spec`` / ``bind_kv_cache`` once (they act on marked
    caches only)."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache as cache_cls

    if getattr(cache_cls.bind_kv_cache, "_dsaindex", False):
        return
    spec_of, bind = cache_cls.get_kv_cache_spec, cache_cls.bind_kv_cache

    def get_kv_cache_spec(self, vllm_config):
        spec = spec_of(self, vllm_config)
        code_bytes = getattr(self, CODE_BYTES, None)
        if code_bytes is None:
            return spec
        if spec.dtype != torch.uint8 or spec.num_kv_heads != 1:
            raise DsaIndexError(f"{self.prefix}: an index-K cache of {spec.dtype} x {spec.num_kv_heads} heads, "
                                "not the uint8 FP8 pages the plugin reads.", "set DSAINDEX_KEYS=device.")
        return dataclasses.replace(spec, head_size=code_bytes)

    def bind_kv_cache(self, kv_cache):
        bind(self, kv_cache)
        code_bytes = getattr(self, CODE_BYTES, None)
        if code_bytes is None:
            return
        region = self.kv_cache
        if region.dim() != 3 or region.shape[2] != code_bytes or not region.is_contiguous():
            raise DsaIndexError(f"{self.prefix}: vLLM bound a pool view of {tuple(region.shape)} with strides "
                                f"{tuple(region.stride())}; the plugin keeps a layer's codes in one run of "
                                f"[blocks, {region.shape[1] if region.dim() > 1 else '?'}, {code_bytes}] bytes.",
                                "use a layer-outer KV cache layout (unset VLLM_KV_CACHE_LAYOUT), or set "
                                "DSAINDEX_KEYS=device.")
        global moved_bytes
        setattr(self, CODES, region)
        from dsaindex.runtime.mapped import host_mapped_zeros

        self.kv_cache = host_mapped_zeros((region.shape[0], region.shape[1], self.head_dim), self.dtype,
                                          region.device)
        moved_bytes += self.kv_cache.numel() * self.kv_cache.element_size()
        logger.info("dsaindex: %s: index keys in pinned host memory (%.2f GB so far, read in place); the KV pool "
                    "counted %d B of codes a key for it instead of %d B.", self.prefix, moved_bytes / 1e9,
                    code_bytes, self.head_dim)

    get_kv_cache_spec._dsaindex = True  # type: ignore[attr-defined]
    bind_kv_cache._dsaindex = True  # type: ignore[attr-defined]
    cache_cls.get_kv_cache_spec = get_kv_cache_spec
    cache_cls.bind_kv_cache = bind_kv_cache
