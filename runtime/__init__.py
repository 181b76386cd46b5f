"""Runtime: what a server imports at startup to load trained artifacts.

``dsaindex.runtime.load_bundle(uri, model_config, device)`` resolves a bundle (local path or
``models:/<name>@<alias>``), validates it against the model and puts its parameters on the device.
Nothing here imports mlflow unless a ``models:/`` URI is given, and nothing on a request's path
touches zarr, faiss or mlflow. The runtime never imports training or pipeline code. Serving a model:
:func:`dsaindex.runtime.serving.serve_index` with :class:`dsaindex.runtime.settings.ServeSettings`.

The names below load on first use, so importing a light module of the package (``settings``, which the
command line reads its option defaults from) does not import torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IVFLayer", "LoadedArtifacts", "PQCodec", "check_bundle_for_model", "load_bundle"]


def __getattr__(name: str) -> Any:
    if name == "check_bundle_for_model":
        from dsaindex.artifacts.compat import check_bundle_for_model

        return check_bundle_for_model
    if name in __all__:
        from dsaindex.runtime import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'dsaindex.runtime' has no attribute {name!r}")
