"""The seam into transformers' own OpenAI-compatible server (``transformers serve``).

transformers' server takes its models from a ``ModelManager``, which loads a checkpoint on the first
request that names it. :class:`PreparedModels` is that manager holding one model the runtime has
already prepared (artifacts resolved, validated and installed): the server's handlers, routes and
generation threads are transformers' own, built the way ``transformers serve`` builds them
(:func:`build_app`); only where the model comes from changes. Continuous batching stays off: transformers
(5.17-5.24) refuses it for DSA layers.
"""

from __future__ import annotations

import inspect
from typing import Any

# the handlers transformers' ``build_server`` takes, by parameter name: module and class
_HANDLERS = {
    "chat_handler": ("chat_completion", "ChatCompletionHandler"),
    "completion_handler": ("completion", "CompletionHandler"),
    "response_handler": ("response", "ResponseHandler"),
    "transcription_handler": ("transcription", "TranscriptionHandler"),
    "systemone_handler": ("systemone", "SystemOneHandler"),
}


def prepared_models(model: Any, tokenizer: Any, model_id: str) -> Any:
    """A transformers ``ModelManager`` serving ``model`` (already prepared) with ``tokenizer`` under
    ``model_id``, pinned: every request gets it, none loads anything."""
    from transformers.cli.serving.model_manager import ModelManager

    class PreparedModels(ModelManager):
        def _load_model(self, *args: Any, **kwargs: Any) -> Any:
            return model

        def _load_processor(self, *args: Any, **kwargs: Any) -> Any:
            return tokenizer

    device = str(next(model.parameters()).device)
    return PreparedModels(device=device, dtype="auto", force_model=model_id, model_timeout=-1)


def build_app(model: Any, tokenizer: Any, model_id: str, enable_cors: bool = False) -> Any:
    """transformers' FastAPI app (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ...)
    serving the prepared ``model``."""
    import importlib

    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.utils import GenerationState

    manager = prepared_models(model, tokenizer, model_id)
    state = GenerationState(continuous_batching=False)
    shared = {"model_manager": manager, "generation_state": state, "chat_template_kwargs": {},
              "decision_config": None}
    wanted = inspect.signature(build_server).parameters
    handlers = {}
    for name, (module, cls_name) in _HANDLERS.items():
        if name not in wanted:
            continue
        cls = getattr(importlib.import_module(f"transformers.cli.serving.{module}"), cls_name)
        takes = inspect.signature(cls.__init__).parameters
        handlers[name] = cls(**{k: v for k, v in shared.items() if k in takes})
    extra = {k: v for k, v in {"generation_state": state, "enable_cors": enable_cors}.items() if k in wanted}
    return build_server(manager, **handlers, **extra)


def run(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
    """Serve ``app`` with uvicorn until interrupted."""
    import uvicorn

    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level)).run()
