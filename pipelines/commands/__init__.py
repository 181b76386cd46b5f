"""Every typer app of the ``dsaindex`` command, one module per command group: ``capture`` (capture, demo),
``store`` and ``registry``, ``train`` (train and eval), ``runtime``, ``serve``, ``plan``, ``bench`` and
``reference``. They parse options and call the library; :mod:`dsaindex.cli` composes them."""
