"""The reference DSA checkpoint as a product: ``corpus`` (its long-range training corpus and synthetic
documents), ``forward`` (model and training forward), ``stages`` (the staged training loop), ``checkpoint``
(writing weights, tokenizer and loss curve), ``train`` (options and the driver), ``tasks`` (passkey
tasks), ``eval``, ``gates`` and ``card``. The checkpoints themselves are data: ``pipelines/reference_model_v2``
(the default) and ``pipelines/reference_model`` (v1)."""
