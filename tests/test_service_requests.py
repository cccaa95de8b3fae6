"""How the server takes requests, through a real server on 127.0.0.1 over the tiny artifacts:
hostile bodies on every POST route, the interactive docs served offline, OpenAI clients that
name another model, and large /tokenize and /decode requests kept off the event loop."""

from __future__ import annotations

import re
import threading

import httpx
import numpy as np
import openai
import pytest

from loadtest.servers import running_app, wait_until
from service.app import create_app
from service.settings import Settings
from service.tokenization import TextTokenizer
from tests.support.service import error_of

PAYLOAD_LIMIT = 65_536


def hostile_bodies(limit: int) -> dict[str, bytes]:
    """Bodies no route may answer with a 5xx, by what is wrong with them; a gRPC test can send the
    same bytes as a message's text."""
    under = b'{"inputs": "' + b"a " * ((limit - 15) // 2)
    under += b" " * (limit - 2 - len(under)) + b'"}'
    return {
        "deep array": b'{"inputs": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
        "deep object": b'{"inputs": ' + b'{"a": ' * 5_000 + b"1" + b"}" * 5_000 + b"}",
        "unclosed nesting": b"[" * 30_000,
        "just under the limit": under,
        "just over the limit": under[:-2] + b' "}',
        "number for inputs": b'{"inputs": 5, "ids": "x", "query": 3, "texts": 4, "input": 6}',
        "list of non-integer numbers": b'{"inputs": [1.5, 2], "ids": [["a"]], "texts": [null]}',
        "token ids out of range": b'{"inputs": [-1, 100000000000000000000], "input": [[-1]], "ids": [[-1]], '
                                  b'"query": [1], "texts": [[1]]}',
        "top-level list": b"[]",
        "top-level string": b'"text"',
        "null": b"null",
        "binary": bytes(range(256)) * 8,
        "invalid utf-8 in a string": b'{"inputs": "\xff\xfe\xfd"}',
        "empty": b"",
    }


@pytest.fixture(scope="module")
def server(serve, tiny_embed_artifact, tiny_classify_artifact):
    with serve([tiny_embed_artifact, tiny_classify_artifact], "--payload-limit", str(PAYLOAD_LIMIT)) as running:
        yield running


def post_routes(url: str) -> list[str]:
    document = httpx.get(f"{url}/openapi.json").json()
    return sorted(path for path, methods in document["paths"].items() if "post" in methods)


def test_every_post_route_refuses_hostile_bodies_with_4xx_and_keeps_serving(server):
    """The same bodies to every POST route: a JSON 4xx each (413 over the limit, 422 for the
    rest but a well-formed body under the limit, which a route may serve), never a 5xx."""
    routes = post_routes(server.url)
    assert {"/", "/embed", "/predict", "/classify", "/rerank", "/tokenize", "/decode", "/similarity",
            "/v1/embeddings"} <= set(routes)
    bodies = hostile_bodies(PAYLOAD_LIMIT)
    assert len(bodies["just under the limit"]) == PAYLOAD_LIMIT
    assert len(bodies["just over the limit"]) == PAYLOAD_LIMIT + 1
    with httpx.Client(base_url=server.url, timeout=60, headers={"content-type": "application/json"}) as client:
        for route in routes:
            for name, body in bodies.items():
                response = client.post(route, content=body)
                where = f"POST {route} with {name}: {response.status_code} {response.text[:200]}"
                if name == "just under the limit":
                    assert response.status_code < 500, where
                    continue
                expected = 413 if name == "just over the limit" else 422
                if name == "token ids out of range" and route in ("/embed_sparse", "/embed_multi", "/embed_hybrid"):
                    expected = 400  # well-formed ids there, but this server has no such model
                assert response.status_code == expected, where
                assert error_of(response)[0], where
        served = client.post("/embed", json={"inputs": "still serving"})
        assert served.status_code == 200 and len(served.json()[0]) == 32


def test_interactive_docs_are_served_from_the_package(server):
    """/docs is Swagger UI whose scripts and styles this server serves itself (no CDN), pointed at
    /openapi.json."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        page = client.get("/docs")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
        assert "http://" not in page.text and "https://" not in page.text, "the page loads something from outside"
        assert {asset.rsplit(".", 1)[-1] for asset in assets} >= {"js", "css"}
        for asset in assets:
            assert asset.startswith("/"), asset
            loaded = client.get(asset)
            assert loaded.status_code == 200 and len(loaded.content) > 100, asset
        assert "SwaggerUIBundle" in client.get(next(a for a in assets if a.endswith(".js"))).text
        assert "'/openapi.json'" in page.text or '"/openapi.json"' in page.text
        document = client.get("/openapi.json")
        assert document.status_code == 200 and "/embed" in document.json()["paths"]


def test_openai_clients_naming_another_model(serve, server, tiny_embed_artifact):
    """One model served: any `model` answers, and the answer names the model that did (LangChain
    sends text-embedding-ada-002 unless told). Several: an unknown name is a 404 listing them."""
    with serve([tiny_embed_artifact]) as alone:
        api = openai.OpenAI(base_url=f"{alone.url}/v1", api_key="unused", max_retries=0, timeout=30)
        answer = api.embeddings.create(model="text-embedding-ada-002", input=["hello there"])
        assert answer.model == "tiny-embed"
        expected = httpx.post(f"{alone.url}/embed", json={"inputs": "hello there"}).json()[0]
        np.testing.assert_allclose(answer.data[0].embedding, expected, atol=1e-6)
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as refused:
        api.embeddings.create(model="text-embedding-ada-002", input=["hello there"])
    listed = str(refused.value)  # what the client shows: OpenAI's error body carries the message
    assert "'tiny-embed'" in listed and "'tiny-classify'" in listed
    assert api.embeddings.create(model="tiny-embed", input=["hello there"]).model == "tiny-embed"


def test_large_tokenize_and_decode_run_off_the_event_loop(tiny_embed_artifact, monkeypatch):
    """/tokenize and /decode of a large request run on the tokenizer thread, as /embed's
    tokenization does, so they never hold every other answer; small ones stay inline."""
    threads: dict[str, list[str]] = {"tokens": [], "decode": []}
    for method in threads:
        real = getattr(TextTokenizer, method)

        def recording(self, *args, _real=real, _calls=threads[method]):
            _calls.append(threading.current_thread().name)
            return _real(self, *args)

        monkeypatch.setattr(TextTokenizer, method, recording)
    app = create_app(Settings(artifacts=[tiny_embed_artifact], workers=1, threads_per_worker=1, wide_worker=False))
    with running_app(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        wait_until(lambda: client.get("/ready").status_code == 200, what="/ready 200")
        assert client.post("/tokenize", json={"inputs": "short"}).status_code == 200
        assert client.post("/decode", json={"ids": [101, 102]}).status_code == 200
        large = client.post("/tokenize", json={"inputs": "many words " * 2000})
        assert large.status_code == 200 and len(large.json()[0]) == 4002
        assert client.post("/decode", json={"ids": [1996] * 5000}).status_code == 200
    assert [name.startswith("tokenize") for name in threads["tokens"]] == [False, True], threads
    assert [name.startswith("tokenize") for name in threads["decode"]] == [False, True], threads
