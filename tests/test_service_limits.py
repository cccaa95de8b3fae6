"""Overload, API key, environment settings, the PyTorch backend and graceful shutdown, each on its
own small server process over the tiny artifacts."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading

import httpx
import numpy as np
import pytest

from loadtest.servers import free_port, metric_value, wait_until
from service.cli import parse_args
from service.settings import Settings
from tests.support.commands import REPO
from tests.support.service import error_of

TEXTS = ["a short one", "a somewhat longer sentence with several more words in it", "tokens " * 30]


def test_settings_come_from_env_and_flags_override(tmp_path):
    env = {"BERT_SERVE_ARTIFACTS": f"{tmp_path}/a,{tmp_path}/b", "BERT_SERVE_PORT": "9001",
           "BERT_SERVE_MAX_WAIT_MS": "7.5", "BERT_SERVE_AUTO_TRUNCATE": "true", "BERT_SERVE_BACKEND": "torch"}
    settings = Settings.load({"port": 9002, "workers": None}, env)
    assert settings.artifacts == [tmp_path / "a", tmp_path / "b"]
    assert (settings.port, settings.max_wait_ms, settings.auto_truncate, settings.backend) == (9002, 7.5, True, "torch")
    env["BERT_SERVE_AUTO_TRUNCATE"] = "false"
    assert Settings.load({"auto_truncate": None}, env).auto_truncate is False
    assert Settings.load({"auto_truncate": True}, env).auto_truncate is True
    assert Settings.load({}, {"BERT_SERVE_ARTIFACTS": "x"}).auto_truncate is True  # TEI's default
    for flags, expected in (([], None), (["--auto-truncate"], True), (["--auto-truncate", "false"], False),
                            (["--auto-truncate=False"], False), (["--no-auto-truncate"], False)):
        assert parse_args(["--artifacts", "x", *flags]).auto_truncate is expected, flags
    with pytest.raises(ValueError):
        Settings.load({}, {"BERT_SERVE_ARTIFACTS": "x", "BERT_SERVE_BACKEND": "onnx"})


def test_full_queue_answers_429_at_once(serve, tiny_embed_artifact):
    """Room for 2 queued inputs, lingering 400 ms: of a 40-request burst some are refused with TEI's
    body, the rest served (that refusals do not queue: test_service_faults, with a blocked worker)."""
    args = ("--max-concurrent-requests", "2", "--max-wait-ms", "400", "--workers", "1")
    with serve([tiny_embed_artifact], *args) as server:

        async def burst():
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                return await asyncio.gather(*(client.post("/embed", json={"inputs": f"request number {i}"})
                                              for i in range(40)))

        results = asyncio.run(asyncio.wait_for(burst(), 60))
        refused = [r for r in results if r.status_code == 429]
        served = [r for r in results if r.status_code == 200]
        assert len(refused) + len(served) == 40 and refused and served
        assert all(r.json() == {"error": "Model is overloaded", "error_type": "Overloaded"} for r in refused)
        assert httpx.post(f"{server.url}/embed", json={"inputs": "after the burst"}, timeout=30).status_code == 200
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'bert_serve_requests_total{endpoint="/embed",status="429"}' in metrics


def test_api_key_guards_every_route_but_the_probes(serve, tiny_embed_artifact):
    """/health and /ready answer without the key (Kubernetes probes send none); the rest need it."""
    env = {"BERT_SERVE_API_KEY": "s3cret", "BERT_SERVE_MAX_CLIENT_BATCH_SIZE": "2"}
    good = {"authorization": "Bearer s3cret"}
    with serve([tiny_embed_artifact], env=env) as server:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200
            assert client.head("/health").status_code == 200 and client.head("/ready").status_code == 200
            for path in ("/", "/ping", "/metrics"):  # open as TEI leaves them: probes and Prometheus' scrape
                assert client.get(path).status_code == 200 and client.head(path).status_code == 200, path
            guarded = (("POST", "/embed"), ("POST", "/"), ("POST", "/invocations"), ("POST", "/v1/embeddings"),
                       ("POST", "/embeddings"), ("GET", "/info"), ("GET", "/docs"), ("GET", "/openapi.json"),
                       ("GET", "/v1/models"))
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"},
                            {"authorization": "Basic s3cret"}, {"authorization": "Bearers3cret"}):
                for method, path in guarded:
                    response = client.request(method, path, json={"inputs": "hi"}, headers=headers)
                    assert response.status_code == 401, (path, headers)
                    assert error_of(response)[1] == "Unauthorized"
            assert client.post("/embed", json={"inputs": "hi"}, headers=good).status_code == 200
            for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive (RFC 7235)
                assert client.post("/embed", json={"inputs": "hi"},
                                   headers={"authorization": f"{scheme} s3cret"}).status_code == 200
            too_many = client.post("/embed", json={"inputs": ["a", "b", "c"]}, headers=good)
            assert too_many.status_code == 413  # BERT_SERVE_MAX_CLIENT_BATCH_SIZE=2 was read


def test_no_auto_truncate_refuses_over_long_inputs_that_do_not_ask_for_truncation(serve, tiny_embed_artifact):
    with serve([tiny_embed_artifact], "--no-auto-truncate") as server:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            long = "word " * 100  # > the tiny model's 64 tokens
            for path, body in (("/embed", {"inputs": long}), ("/v1/embeddings", {"input": long})):
                response = client.post(path, json=body)
                assert response.status_code == 413 and "at most 64 tokens" in error_of(response)[0], path
            assert client.post("/embed", json={"inputs": long, "truncate": True}).status_code == 200
            assert client.get("/info").json()["auto_truncate"] is False


def test_torch_backend_serves_the_same_api(serve, tiny_embed_artifact, tiny_classify_artifact, tiny_bert_dir,
                                           tiny_classifier_dir):
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification, BertModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_classifier_dir)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():  # Hugging Face's own modules: mean pooling and softmax written out here
        hidden = BertModel.from_pretrained(tiny_bert_dir, add_pooling_layer=False).eval()(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()
        logits = BertForSequenceClassification.from_pretrained(tiny_classifier_dir).eval()(**batch).logits
        probs = torch.softmax(logits, -1).numpy()
    with serve([tiny_embed_artifact, tiny_classify_artifact], "--backend", "torch", "--threads-per-worker", "1") as server:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            response = client.post("/embed", json={"inputs": TEXTS})
            assert response.status_code == 200 and response.headers["x-compute-path"] == "torch"
            np.testing.assert_allclose(response.json(), expected, atol=1e-5)
            predictions = client.post("/classify", json={"inputs": [[text] for text in TEXTS]}).json()
            labels = ["negative", "neutral", "positive"]
            got = [[{p["label"]: p["score"] for p in row}[label] for label in labels] for row in predictions]
            np.testing.assert_allclose(got, probs, atol=1e-5)
            assert client.get("/info").json()["backend"] == "torch"


def test_sigterm_finishes_queued_work_then_exits(serve, tiny_embed_artifact):
    """Requests lingering in the queue when SIGTERM arrives are still answered; then exit 0.

    The server expects company and plans by padded tokens (tests/support/server_expecting_company.py), so
    three single inputs wait (up to 60 s) for a fourth to fill the 4x16 bucket, whatever the speed
    of this machine; the drain must send them at once."""
    env = {"PYTHONPATH": str(REPO)}
    with serve([tiny_embed_artifact], "--max-wait-ms", "60000", "--workers", "1", "--no-wide-worker",
               env=env, module="tests.support.server_expecting_company") as server:
        statuses: list[int] = []

        def send(i: int) -> None:
            statuses.append(httpx.post(f"{server.url}/embed", json={"inputs": f"in flight {i}"}, timeout=30).status_code)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        wait_until(lambda: metric_value(server.url, "bert_serve_queue_depth", model="tiny-embed") == 3,
                   what="three single inputs lingering")
        assert statuses == []
        server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=30)
        assert statuses == [200, 200, 200]
        assert server.process.wait(timeout=30) == 0


def _refuses_connections(url: str) -> bool:
    """Whether a new connection goes unserved: refused, or (taken from the listen backlog as the
    server stops listening) closed without an answer."""
    try:
        httpx.get(f"{url}/health", timeout=5)
    except (httpx.ConnectError, httpx.RemoteProtocolError):
        return True
    return False


def _grpc_refuses(address: str) -> bool:
    import grpc

    from service.grpc_api import tei_pb2 as pb
    from service.grpc_api import tei_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.InfoStub(channel).Info(pb.InfoRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.UNAVAILABLE
    return False


def test_sigterm_answers_a_request_still_tokenizing(serve, tiny_embed_artifact):
    """A request received before SIGTERM is answered even while its inputs are still being
    tokenized, before they reach a queue; connections made after the signal are refused, and so
    are gRPC calls.

    The server's tokenizer holds the request until the test lets it go
    (tests/support/server_holding_tokenization.py): the signal comes while it tokenizes, whatever the
    speed of this machine. Its 32 inputs, over 2048 characters, are tokenized off the event loop."""
    inputs = [f"hold {i}: " + "a few more words " * 8 for i in range(32)]
    with socket.create_server(("127.0.0.1", 0)) as hold:
        hold.settimeout(120)
        env = {"PYTHONPATH": str(REPO), "HOLD_PORT": str(hold.getsockname()[1])}
        grpc_port = free_port()
        with serve([tiny_embed_artifact], "--grpc-port", str(grpc_port), env=env,
                   module="tests.support.server_holding_tokenization") as server:
            assert not _grpc_refuses(f"127.0.0.1:{grpc_port}")
            answers: list[httpx.Response] = []
            request = threading.Thread(target=lambda: answers.append(
                httpx.post(f"{server.url}/embed", json={"inputs": inputs}, timeout=120)))
            request.start()
            tokenizer, _ = hold.accept()
            with tokenizer:
                assert tokenizer.recv(10) == b"tokenizing"
                server.process.send_signal(signal.SIGTERM)
                wait_until(lambda: _refuses_connections(server.url), what="new connections refused")
                wait_until(lambda: _grpc_refuses(f"127.0.0.1:{grpc_port}"), what="new gRPC calls refused")
                assert answers == []
                tokenizer.sendall(b"go")
            request.join(timeout=120)
            assert answers[0].status_code == 200, answers[0].text
            assert len(answers[0].json()) == len(inputs)
            assert server.process.wait(timeout=60) == 0


def test_a_multi_label_head_scores_each_label_with_a_sigmoid(serve, tmp_path, tiny_classifier_dir):
    """A checkpoint trained with problem_type multi_label_classification: scores are per-label
    sigmoids, as transformers computes them for that head (and as TEI serves them), not a softmax."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    from artifact.manifest import Manifest
    from tests.support.artifacts import compile_artifact

    checkpoint = tmp_path / "multi-label"
    model = BertForSequenceClassification.from_pretrained(tiny_classifier_dir, problem_type="multi_label_classification")
    model.save_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(tiny_classifier_dir)
    tokenizer.save_pretrained(checkpoint)
    artifact = tmp_path / "artifacts" / "multi-label"
    compile_artifact(checkpoint, artifact, ["4x16"], task="classify", generic_shapes=["3x5"])
    assert Manifest.read(artifact).problem_type == "multi_label_classification"
    with torch.no_grad():
        logits = model.eval()(**tokenizer(TEXTS[:2], padding=True, return_tensors="pt")).logits
    with serve([artifact]) as server:
        predictions = httpx.post(f"{server.url}/classify", json={"inputs": [[text] for text in TEXTS[:2]]},
                                 timeout=30).json()
    labels = ["negative", "neutral", "positive"]
    got = [[{p["label"]: p["score"] for p in row}[label] for label in labels] for row in predictions]
    np.testing.assert_allclose(got, torch.sigmoid(logits).numpy(), atol=1e-5)
    assert not np.allclose(np.sum(got, axis=1), 1.0)  # not a softmax
