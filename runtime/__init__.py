"""Runtime: what a server imports at startup to load trained artifacts.

``dsaindex.runtime.load(uri, model_config, device)`` resolves a bundle (local path or
``models:/<name>@<alias>``), validates it against the model and puts its parameters on the device.
Nothing here imports mlflow unless a ``models:/`` URI is given, and nothing on a request's path
touches zarr, faiss or mlflow. The runtime never imports training or pipeline code.
"""

from dsaindex.artifacts.compat import check_bundle_for_model
from dsaindex.runtime.loader import IVFLayer, LoadedArtifacts, PQCodec, load

__all__ = ["IVFLayer", "LoadedArtifacts", "PQCodec", "check_bundle_for_model", "load"]
