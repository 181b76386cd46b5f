"""Runtime: what a server imports at startup to load trained artifacts.

``dsaindex.runtime.load(uri, model_config, device)`` resolves a bundle (local path or
``models:/<name>@<alias>``), validates it against the model and puts its parameters on the device.
Nothing here imports mlflow unless a ``models:/`` URI is given, and nothing on a request's path
touches zarr, faiss or mlflow.
"""

from dsaindex.runtime.loader import IVFLayer, LoadedArtifacts, PQLayer, check_compatible, load

__all__ = ["IVFLayer", "LoadedArtifacts", "PQLayer", "check_compatible", "load"]
