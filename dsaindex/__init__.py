"""dsaindex: offline index building and runtime artifact loading for DeepSeek Sparse Attention models.

The top-level folders of the repository install as subpackages of this one import name:
``dsaindex.pipelines`` (capture, corpus, demo), ``dsaindex.train``, ``dsaindex.artifacts``
(every on-disk format), ``dsaindex.runtime`` and ``dsaindex.kernels``. This folder holds what they
all share: the version, the CLI and the domain core (:mod:`dsaindex.geometry`,
:mod:`dsaindex.score`, :mod:`dsaindex.quant`, :mod:`dsaindex.indexer`).
"""

from dsaindex._version import __version__

__all__ = ["__version__"]
