"""Pipelines: the rooms that run models and flows, in the order of the data flow.

* :mod:`~dsaindex.pipelines.capture`: step 1, running a model over a corpus and recording its indexer's
  keys, queries and head weights (models and presets, corpora and token streams, the indexer tap, the
  capture run), and indexer-only distillation for reuse plans (it runs the model's layers too);
* :mod:`~dsaindex.pipelines.reference`: the reference checkpoint as a product (its corpus, training,
  evaluation, gates and card);
* :mod:`~dsaindex.pipelines.bench`: the ``dsaindex bench`` measurements and the one timing module;
* :mod:`~dsaindex.pipelines.commands`: every typer app of the ``dsaindex`` command.
"""
