"""``dsaindex bench ...``: decode (``decode``), prefill selection (``prefill``), streamed prefill (``stream``),
cross-layer reuse (``reuse``) and the training job (``pq_job``), all timed by ``timing``."""
