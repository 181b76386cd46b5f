"""Triton kernels of the indexer, each beside its torch reference.

Convention: in ``kernels/<topic>.py`` the Triton wrapper ``X`` (checks its inputs with
:mod:`dsaindex.kernels.checks`, raising ``ValueError``; allocates; launches) sits beside its torch
reference ``X_reference`` (the spec: same data arguments, same return; tests compare the two, on the
CPU through ``TRITON_INTERPRET=1``); the ``@triton.jit`` code is in ``kernels/<topic>_kernel.py``.
Triton is imported only inside the wrappers. Kernels import only the core (``dsaindex/*.py``).

Public API, by module:

* :mod:`~dsaindex.kernels.fp8_score`: ``fp8_topk``, ``fp8_gather_scores`` (+ ``_reference``);
  ``fp8_logits`` (every score written, FP8 x FP8 products: the portable exact scorer with ``rows_topk``);
  ``fp8_topk_paged`` and ``fp8_logits_paged`` over the engines' pages (``paged_keys_reference`` unpacks
  them); ``fp8_scores_reference``, the exact score all are specified by.
* :mod:`~dsaindex.kernels.pq_select`: ``pq_linear_topc``, ``pq_candidate_scores``, ``pq_encode``
  (+ ``_reference``); ``pq_linear_scores_reference``, ``folded_lookup_tables`` (``lookup_tables``: the
  same in one launch, optionally float16).
* :mod:`~dsaindex.kernels.pq_scan_cuda`: ``pq_scan_select``, stage 1's selecting pass as a CUDA kernel
  (int32 tables in shared memory read at lane-rotated columns; NVRTC through torch), taken by
  ``pq_linear_topc``'s default ``scan="auto"`` on a CUDA device; its spec is the Triton pass beside it.
* :mod:`~dsaindex.kernels.topk`: ``rows_topk`` (threshold top-k of long rows) and ``small_topk`` (rows of
  up to 16K entries, one program each), each + ``_reference``.
* :mod:`~dsaindex.kernels.deepgemm`: the engines' exact indexer (DeepGEMM), where it imports.
* :mod:`~dsaindex.kernels.chunk_score`: ``chunk_scores`` (+ ``_reference``).
* :mod:`~dsaindex.kernels.decode_plan`: ``decode_plan`` (+ ``_reference``).
* :mod:`~dsaindex.kernels.select`: ``gather_host_rows`` (+ ``_reference``, also the fallback where the
  device cannot address pinned memory); the threshold-selection helpers the fused kernels share
  (``sample_stride``, ``sample_thresholds`` with its spec ``thresholds_from_samples``, ``new_buffers``,
  ``top_of_buffer``,
  ``topk_of_prefixes``, ``check_counts``, ``interpreted``).
* :mod:`~dsaindex.kernels.checks`: the shared input checks.
"""
