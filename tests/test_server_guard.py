"""The server answers a client's mistake with a 4xx naming it, never a 500, and bounds the generation
requests in flight (429 past the limit, every request answered). Through transformers' own app
(:func:`dsaindex.runtime.server.build_app`) over a tiny preset model, in process."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def client():
    from starlette.testclient import TestClient

    from dsaindex.pipelines.capture.models import load_model
    from dsaindex.runtime.server import build_app

    loaded = load_model("preset:tiny-v32", dtype="float32")
    app = build_app(loaded.model, loaded.tokenizer.for_transformers(), "dsaindex/tiny")
    with TestClient(app, raise_server_exceptions=False) as c:
        c.positions = loaded.model.config.max_position_embeddings
        yield c


def error_of(response) -> str:
    return response.json()["error"]["message"]


def test_chat_on_a_base_model_is_a_400_naming_completions(client):
    r = client.post("/v1/chat/completions", json={"model": "dsaindex/tiny", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400, r.text
    assert "chat template" in error_of(r) and "/v1/completions" in error_of(r)


@pytest.mark.parametrize("value", [-1, 0, 2.5, "8", True])
def test_bad_max_tokens_is_a_400(client, value):
    r = client.post("/v1/completions", json={"model": "dsaindex/tiny", "prompt": "hello", "max_tokens": value})
    assert r.status_code == 400, r.text
    assert "max_tokens" in error_of(r) and "positive integer" in error_of(r)


def test_a_prompt_beyond_the_models_positions_is_a_400_naming_the_limit(client):
    prompt = "a" * (client.positions + 10)  # one token a byte
    r = client.post("/v1/completions", json={"model": "dsaindex/tiny", "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert f"{client.positions:,} positions" in error_of(r)


def test_a_body_that_is_not_json_is_a_400(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not JSON" in error_of(r)
    r = client.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in error_of(r)


def test_a_good_completion_still_reaches_transformers(client):
    r = client.post("/v1/completions", json={"model": "dsaindex/tiny", "prompt": "hello", "max_tokens": 3,
                                            "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert client.get("/v1/models").status_code == 200  # other routes pass untouched


def test_past_the_limit_requests_are_refused_429_and_none_is_dropped():
    """Three requests at once against a limit of 2: two reach the app (held until released), the third is
    answered 429 with Retry-After at once; when the two finish, a new one is taken again."""
    from dsaindex.runtime.server import RequestGuard

    release = asyncio.Event()
    reached = []

    async def app(scope, receive, send):
        body = (await receive())["body"]
        reached.append(json.loads(body)["prompt"])
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = RequestGuard(app, tokenizer=None, max_positions=None, model_id="m", max_in_flight=2)

    async def request(prompt):
        sent = []
        body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions"}
        await guard(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        return start["status"], dict(start["headers"])

    async def main():
        first = [asyncio.create_task(request(p)) for p in ("a", "b")]
        while len(reached) < 2:  # both inside the app (no clock: the loop runs them until they wait)
            await asyncio.sleep(0)
        status, headers = await request("c")
        assert (status, headers[b"retry-after"]) == (429, b"1")
        release.set()
        assert [(await t)[0] for t in first] == [200, 200]
        assert guard.in_flight == 0
        assert (await request("d"))[0] == 200

    asyncio.run(main())
    assert reached == ["a", "b", "d"]


def test_prompts_are_prefilled_in_chunks_with_the_answer_of_a_whole_prefill():
    """The server prefills a prompt ``chunk`` tokens at a time (transformers' attention for DSA layers is dense
    under a mask: a whole 64K prompt at once holds [heads, S, S] scores); the answer is the whole prefill's."""
    from starlette.testclient import TestClient

    from dsaindex.geometry import geometry_from_config
    from dsaindex.hooks import ModuleHooks
    from dsaindex.indexer import find_indexers
    from dsaindex.pipelines.capture.models import load_model
    from dsaindex.runtime.server import build_app

    loaded = load_model("preset:tiny-v32", dtype="float32")
    net, tokenizer = loaded.model, loaded.tokenizer.for_transformers()
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    n = len(tokenizer(prompt)["input_ids"])
    answers = {}
    for chunk in (16, 4096):
        sizes: list[int] = []
        hooks = ModuleHooks()
        with hooks, TestClient(build_app(net, tokenizer, "dsaindex/tiny", chunk=chunk)) as client:
            indexers = find_indexers(net, geometry_from_config(net.config))
            hooks.register(indexers[min(indexers)], pre=lambda mod, a, seen=sizes: seen.append(a["hidden_states"].shape[1]))
            r = client.post("/v1/completions", json={"model": "dsaindex/tiny", "prompt": prompt, "max_tokens": 4,
                                                    "temperature": 0})
        assert r.status_code == 200, r.text
        answers[chunk] = r.json()["choices"][0]["text"]
        prefill = [s for s in sizes if s > 1]
        assert sum(prefill) == n and max(prefill) == min(chunk, n), (chunk, sizes)
        if chunk < n:
            assert len(prefill) == -(-n // chunk)
    assert answers[16] == answers[4096]


def test_the_default_chunk_bounds_the_attention_scores_at_the_last_position():
    from types import SimpleNamespace

    from dsaindex.runtime.server import CHUNK_SCORE_BYTES, prefill_chunk

    for heads, positions in ((4, 65536), (128, 163840), (16, 2048), (64, 1 << 20)):
        config = SimpleNamespace(num_attention_heads=heads, max_position_embeddings=positions)
        chunk = prefill_chunk(config)
        assert 64 <= chunk <= 4096 and chunk & (chunk - 1) == 0
        assert chunk == 64 or heads * chunk * positions * 4 <= CHUNK_SCORE_BYTES
        assert chunk == 4096 or heads * 2 * chunk * positions * 4 > CHUNK_SCORE_BYTES  # the largest that fits
    assert prefill_chunk(SimpleNamespace(num_attention_heads=4, max_position_embeddings=65536), 100) == 100
