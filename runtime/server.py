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


# device bytes the dense attention of one prefill chunk may take for its scores (heads x chunk x positions fp32)
CHUNK_SCORE_BYTES = 1 << 30


def prefill_chunk(config: Any, requested: int | None = None) -> int:
    """Tokens a prompt's prefill runs at once: ``requested``, else the largest power of two from 64 to 4,096
    whose attention scores at the model's last position (heads x chunk x positions x 4 bytes) fit in
    :data:`CHUNK_SCORE_BYTES`. transformers' attention for DSA models is dense under a mask, so a whole
    prompt at once holds [heads, S, S] scores (and the model's own indexer [H, S, S]); in chunks a prompt up
    to the model's positions is served in bounded memory."""
    if requested is not None:
        return int(requested)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    positions = int(getattr(config, "max_position_embeddings", 0) or 0) or 4096
    chunk = 4096
    while chunk > 64 and heads * chunk * positions * 4 > CHUNK_SCORE_BYTES:
        chunk //= 2
    return chunk


def build_app(model: Any, tokenizer: Any, model_id: str, enable_cors: bool = False,
              max_in_flight: int | None = None, chunk: int | None = None) -> Any:
    """transformers' FastAPI app (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ...)
    serving the prepared ``model``, behind :class:`RequestGuard` (a client's mistake is a 4xx, at most
    ``max_in_flight`` generation requests at once). Prompts are prefilled ``chunk`` tokens at a time
    (transformers' ``prefill_chunk_size``; default :func:`prefill_chunk`)."""
    import importlib

    model.generation_config.prefill_chunk_size = prefill_chunk(model.config, chunk)

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
    app = build_server(manager, **handlers, **extra)
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return RequestGuard(app, tokenizer, positions, model_id, max_in_flight or MAX_IN_FLIGHT)


def run(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
    """Serve ``app`` with uvicorn until interrupted."""
    import uvicorn

    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level)).run()


# ---- what a client may send: checked before transformers' handlers see it ---------------------------
GENERATION_PATHS = {"/v1/completions": "completion", "/v1/chat/completions": "chat", "/v1/responses": "response"}
MAX_IN_FLIGHT = 16  # generation requests the server takes at once; more are answered 429


class RequestGuard:
    """An ASGI middleware in front of transformers' app that answers a client's mistake with a 4xx naming it,
    before it can become a 500 inside a handler, and bounds the generation requests in flight.

    Checked on ``POST`` to the generation routes: the body is a JSON object; ``max_tokens`` /
    ``max_completion_tokens`` / ``max_output_tokens`` are positive integers; a chat request needs a chat
    template (a base checkpoint has none: 400 naming ``/v1/completions``); the prompt and the tokens asked
    for fit the model's positions (400 naming the limit). Beyond ``max_in_flight`` requests at once the
    answer is 429 with ``Retry-After``: every request is answered or refused, none dropped."""

    def __init__(self, app: Any, tokenizer: Any, max_positions: int | None, model_id: str,
                 max_in_flight: int = MAX_IN_FLIGHT):
        self.app, self.tokenizer, self.max_positions, self.model_id = app, tokenizer, max_positions, model_id
        self.max_in_flight = max(1, int(max_in_flight))
        self.in_flight = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        kind = GENERATION_PATHS.get(scope.get("path", "")) if scope.get("type") == "http" else None
        if kind is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        problem = self.problem(kind, body)
        if problem is not None:
            await _json_error(send, 400, problem, "invalid_request_error")
            return
        if self.in_flight >= self.max_in_flight:
            await _json_error(send, 429, f"The server has {self.in_flight} generation requests in flight, its limit; "
                                         "retry after a moment.", "rate_limit_error", retry_after=1)
            return
        self.in_flight += 1
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            await self.app(scope, replay, send)
        finally:
            self.in_flight -= 1

    def problem(self, kind: str, body: bytes) -> str | None:
        """What is wrong with a generation request (None: nothing this guard can tell)."""
        import json

        try:
            request = json.loads(body or b"null")
        except (ValueError, UnicodeDecodeError):
            return "The request body is not JSON: send a JSON object (Content-Type: application/json)."
        if not isinstance(request, dict):
            return "The request body is not a JSON object: send {\"model\": ..., \"prompt\": ...}."
        asked = None
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = request.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                return f"`{key}` is {value!r}; it must be a positive integer (the tokens to generate)."
            asked = value
        if kind == "chat":
            if not getattr(self.tokenizer, "chat_template", None):
                return (f"The model {self.model_id} has no chat template (a base checkpoint), so it cannot take "
                        "chat messages: send the text as `prompt` to /v1/completions.")
            messages = request.get("messages")
            if not isinstance(messages, list) or not messages:
                return "`messages` must be a non-empty list of {\"role\": ..., \"content\": ...} objects."
        tokens = self._prompt_tokens(kind, request)
        if self.max_positions and tokens is not None and tokens + (asked or 1) > self.max_positions:
            return (f"The prompt is {tokens:,} tokens and {asked or 1:,} more are asked for; the model "
                    f"{self.model_id} has {self.max_positions:,} positions. Send a shorter prompt or ask for "
                    "fewer tokens.")
        return None

    def _prompt_tokens(self, kind: str, request: dict) -> int | None:
        try:
            if kind == "completion" and isinstance(request.get("prompt"), str):
                return len(self.tokenizer(request["prompt"])["input_ids"])
            if kind == "chat":
                return len(self.tokenizer.apply_chat_template(request["messages"], tokenize=True,
                                                              add_generation_prompt=True))
        except Exception:  # noqa: BLE001 - a form this guard does not read: the handler answers it
            return None
        return None


async def _json_error(send: Any, status: int, message: str, kind: str, retry_after: int | None = None) -> None:
    import json

    payload = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
