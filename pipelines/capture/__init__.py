"""Step 1 of the flow: run a DSA model over a corpus and record its indexer.

``presets`` (built-in configs) and ``models`` (loading a checkpoint, a preset or the reference model);
``corpus`` (text readers) and ``tokens`` (token streams and windows of a corpus); ``tap`` (forward hooks on
the indexer modules); ``run`` (:func:`~dsaindex.pipelines.capture.run.capture`: the resumable capture into a
store); ``indexer_distill`` (retraining the indexers a reuse plan keeps).
"""
