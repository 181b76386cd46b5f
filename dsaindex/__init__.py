"""dsaindex: offline index building and runtime artifact loading for DeepSeek Sparse Attention models.

The top-level folders of the repository install as subpackages of this one import name:
``dsaindex.pipelines`` (capture, corpus, demo), ``dsaindex.train``, ``dsaindex.artifacts``
(every on-disk format), ``dsaindex.runtime`` and ``dsaindex.kernels``. This folder holds what they
all share: the version, the CLI and the domain core (:mod:`dsaindex.geometry`,
:mod:`dsaindex.score`, :mod:`dsaindex.quant`, :mod:`dsaindex.indexer`).
"""

import os as _os
import sys as _sys

from dsaindex._version import __version__

__all__ = ["__version__"]


def _unshadow() -> None:
    """In a checkout, the subpackages are top-level folders (``kernels/``, ``runtime/``, ...) and are imported
    as ``dsaindex.<name>`` only. ``python -m`` run from the checkout puts its root on ``sys.path``, where
    ``kernels/`` would shadow the installed package of that name (Hugging Face's ``kernels``, which
    transformers imports): drop the root from ``sys.path`` (``dsaindex`` itself is found by the install's
    own finder, or is already imported)."""
    here = _os.path.dirname(_os.path.realpath(__file__))
    root = _os.path.dirname(here)
    link = _os.path.join(here, "kernels")
    if not (_os.path.islink(link) and _os.path.realpath(link) == _os.path.join(root, "kernels")):
        return  # an installed wheel (dsaindex/kernels is a folder of its own): nothing to shadow
    _sys.path[:] = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != root]
    shadow = _sys.modules.get("kernels")
    if shadow is not None and _os.path.realpath(getattr(shadow, "__file__", "") or "").startswith(root + _os.sep):
        del _sys.modules["kernels"]


_unshadow()
