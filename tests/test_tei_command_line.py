"""TEI's command line on real servers: OpenTelemetry traces to an OTLP/HTTP collector stand-in,
CORS, a unix socket, metrics on their own port, JSON logs, TEI's names for our flags, and the TEI
flags that mean nothing here, each refused in one line."""

from __future__ import annotations

import gzip
import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from artifact.manifest import Manifest
from loadtest.servers import free_port, metric_value, wait_until
from service.runtime import TEI_DTYPES, model_dtype
from service.settings import Settings

REPO = Path(__file__).resolve().parents[1]
TEXTS = ["a short one", "a somewhat longer sentence with several more words in it"]


class OtlpCollector:
    """An OTLP/HTTP trace receiver on 127.0.0.1: every span POSTed to /v1/traces, decoded."""

    def __init__(self):
        self.spans: list = []  # (service.name, span)
        self.paths: list[str] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                export = ExportTraceServiceRequest.FromString(body)
                for resource_spans in export.resource_spans:
                    attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    for scope_spans in resource_spans.scope_spans:
                        collector.spans += [(attributes.get("service.name"), span) for span in scope_spans.spans]
                collector.paths.append(self.path)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def named(self, name: str) -> list:
        return [span for _, span in self.spans if span.name == name]


@pytest.fixture(scope="module")
def traced(serve, tiny_embed_artifact):
    """A server exporting its traces to a collector stand-in every 50 ms (not every 5 s), with gRPC beside HTTP."""
    collector, port = OtlpCollector(), free_port()
    with serve([tiny_embed_artifact], "--otlp-endpoint", collector.url, "--otlp-service-name", "embedder",
               "--grpc-port", str(port), env={"OTEL_BSP_SCHEDULE_DELAY": "50"}) as server:
        server.grpc = f"127.0.0.1:{port}"
        yield server, collector
    collector.server.shutdown()
    collector.server.server_close()


def assert_stages_inside(collector: OtlpCollector, request) -> list:
    """`request`'s tokenize, queue and inference spans: its children, within it and in order."""
    stages = [next(span for span in collector.named(name) if span.parent_span_id == request.span_id)
              for name in ("tokenize", "queue", "inference")]
    for stage in stages:
        assert stage.trace_id == request.trace_id, stage.name
        assert request.start_time_unix_nano <= stage.start_time_unix_nano <= stage.end_time_unix_nano
        assert stage.end_time_unix_nano <= request.end_time_unix_nano, stage.name
    assert all(s.end_time_unix_nano <= t.start_time_unix_nano for s, t in zip(stages, stages[1:]))
    return stages


def test_each_request_is_traced_with_its_stages_as_child_spans(traced):
    """A server span per request, named by its route and a child of the caller's `traceparent`,
    with tokenize, queue and inference spans inside it, in order; exported with the service name."""
    server, collector = traced
    trace_id, caller_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    response = httpx.post(f"{server.url}/embed", json={"inputs": TEXTS}, timeout=30,
                          headers={"traceparent": f"00-{trace_id}-{caller_span}-01"})
    assert response.status_code == 200
    wait_until(lambda: collector.named("POST /embed") and collector.named("inference"), what="spans exported")
    (request,) = collector.named("POST /embed")
    assert request.trace_id.hex() == trace_id and request.parent_span_id.hex() == caller_span
    assert {a.key: a.value.int_value for a in request.attributes}["http.response.status_code"] == 200
    stages = assert_stages_inside(collector, request)
    assert {a.key: a.value.int_value for a in stages[0].attributes}["inputs"] == len(TEXTS)
    assert {name for name, _ in collector.spans} == {"embedder"}
    assert set(collector.paths) == {"/v1/traces"}


def test_each_grpc_call_is_traced_like_a_request(traced):
    """A gRPC call gets the span an HTTP request does: `tei.v1.Embed/Embed`, a child of the `traceparent`
    in its metadata, with its status code and tokenize, queue and inference spans inside; a stream, one span
    with each message's stages; a refused call, its code."""
    import grpc

    from service.grpc_api import retrieval_pb2 as rpb
    from service.grpc_api import retrieval_pb2_grpc as rpb_grpc
    from service.grpc_api import tei_pb2 as pb
    from service.grpc_api import tei_pb2_grpc as pb_grpc

    server, collector = traced
    trace_id, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with grpc.insecure_channel(server.grpc) as channel:
        embed = pb_grpc.EmbedStub(channel)
        embed.Embed(pb.EmbedRequest(inputs=TEXTS[0]), metadata=[("traceparent", f"00-{trace_id}-{caller_span}-01")])
        assert len(list(embed.EmbedStream(iter([pb.EmbedRequest(inputs=text) for text in TEXTS])))) == len(TEXTS)
        with pytest.raises(grpc.RpcError) as refused:
            embed.Embed(pb.EmbedRequest(inputs=""))
        with pytest.raises(grpc.RpcError) as no_colbert:  # bertserve.v1's methods too (no ColBERT model here)
            rpb_grpc.EmbedMultiStub(channel).EmbedMulti(rpb.EmbedMultiRequest(inputs=TEXTS[0]))
    assert refused.value.code() == no_colbert.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wait_until(lambda: len(collector.named("tei.v1.Embed/Embed")) == 2 and collector.named("tei.v1.Embed/EmbedStream")
               and len(collector.named("inference")) >= 3, what="the calls' spans exported")
    call, failed = sorted(collector.named("tei.v1.Embed/Embed"), key=lambda span: span.start_time_unix_nano)
    assert call.trace_id.hex() == trace_id and call.parent_span_id.hex() == caller_span
    attributes = {a.key: a.value for a in call.attributes}
    assert (attributes["rpc.system"].string_value, attributes["rpc.service"].string_value,
            attributes["rpc.method"].string_value, attributes["rpc.grpc.status_code"].int_value) == (
        "grpc", "tei.v1.Embed", "Embed", 0)
    assert_stages_inside(collector, call)
    assert {a.key: a.value.int_value for a in failed.attributes}["rpc.grpc.status_code"] == \
        grpc.StatusCode.INVALID_ARGUMENT.value[0]
    wait_until(lambda: collector.named("bertserve.v1.EmbedMulti/EmbedMulti"), what="EmbedMulti's span exported")
    (multi,) = collector.named("bertserve.v1.EmbedMulti/EmbedMulti")
    assert {a.key: a.value.string_value for a in multi.attributes}["rpc.service"] == "bertserve.v1.EmbedMulti"
    assert {a.key: a.value.int_value for a in multi.attributes}["rpc.grpc.status_code"] == \
        grpc.StatusCode.INVALID_ARGUMENT.value[0]
    (stream,) = collector.named("tei.v1.Embed/EmbedStream")
    assert sum(span.parent_span_id == stream.span_id for span in collector.named("inference")) == len(TEXTS)


ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def tei_server(serve, tiny_embed_artifact, tmp_path_factory):
    """One server started with TEI's flags: CORS for ORIGIN and an API key, a unix socket,
    metrics on their own port, JSON logs at info, TEI's --dtype and --pooling as the tiny model
    was compiled, two tokenization workers."""
    socket_path = tmp_path_factory.mktemp("uds") / "bert.sock"
    metrics_port = free_port()
    manifest = Manifest.read(tiny_embed_artifact)
    dtype = TEI_DTYPES.get(model_dtype(manifest))  # None for int8, which TEI cannot name
    flags = ["--dtype", dtype] if dtype else []
    with serve([tiny_embed_artifact], "--cors-allow-origin", ORIGIN, "--api-key", "secret", "--uds-path",
               str(socket_path), "--prometheus-port", str(metrics_port), "--json-output", "--log-level", "info",
               "--pooling", "mean", "--tokenization-workers", "2", *flags) as server:
        server.socket_path, server.metrics_port = socket_path, metrics_port
        yield server
    assert not socket_path.exists(), "the unix socket is removed on exit"


KEY = {"authorization": "Bearer secret"}


def test_cors_preflight_needs_no_key_and_names_the_allowed_origin(tei_server):
    asks = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}
    preflight = httpx.options(f"{tei_server.url}/embed", headers={"origin": ORIGIN, **asks})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    elsewhere = httpx.options(f"{tei_server.url}/embed", headers={"origin": "https://other.example", **asks})
    assert elsewhere.status_code == 400 and "access-control-allow-origin" not in elsewhere.headers
    answer = httpx.post(f"{tei_server.url}/embed", json={"inputs": TEXTS}, headers={"origin": ORIGIN, **KEY})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGIN
    assert httpx.post(f"{tei_server.url}/embed", json={"inputs": TEXTS}, headers={"origin": ORIGIN}).status_code == 401


def test_the_unix_socket_serves_the_same_api(tei_server):
    over_tcp = httpx.post(f"{tei_server.url}/embed", json={"inputs": TEXTS}, headers=KEY).json()
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(tei_server.socket_path)), base_url="http://bert") as client:
        assert client.get("/ready").status_code == 200
        response = client.post("/embed", json={"inputs": TEXTS}, headers=KEY)
        assert response.status_code == 200 and response.json() == over_tcp
        assert client.post("/embed", json={"inputs": TEXTS}).status_code == 401


def test_metrics_on_their_own_port_and_still_on_the_main_one(tei_server):
    httpx.post(f"{tei_server.url}/embed", json={"inputs": TEXTS}, headers=KEY)
    own_port = f"http://127.0.0.1:{tei_server.metrics_port}"
    answered = metric_value(own_port, "bert_serve_requests_total", endpoint="/embed", status="200")
    assert answered >= 1
    assert metric_value(tei_server.url, "bert_serve_requests_total", endpoint="/embed", status="200") >= answered


def test_json_output_writes_every_log_line_as_json(tei_server):
    lines = tei_server.log.read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    assert entries and all({"ts", "level", "logger", "msg"} <= entry.keys() for entry in entries)
    assert any(entry["msg"].startswith("ready in") for entry in entries)


def test_tei_dtype_pooling_and_tokenization_workers_are_taken(tei_server):
    info = httpx.get(f"{tei_server.url}/info", headers=KEY).json()
    assert info["tokenization_workers"] == 2
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}


def _refusal(*args: str) -> list[str]:
    """The stderr lines of `python -m service ARGS`, which must exit 2."""
    result = subprocess.run([sys.executable, "-m", "service", "--port", str(free_port()), *args], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.returncode, result.stderr)
    return result.stderr.strip().splitlines()


@pytest.mark.parametrize("flags,message", [
    (["--dtype", "float16"], "computes in"),
    (["--pooling", "cls"], "pools by mean, chosen when it was compiled; compile it with bert-compile --pooling"),
    (["--pooling", "last-token"], "bert-compile --pooling mean|cls|max|none|splade"),
    (["--device-id", "1"], "--device-id: a CUDA model runs on the first GPU it sees: pick it with CUDA_VISIBLE_"),
    (["--dense-path", "2_Dense"], "--dense-path: the Dense modules are compiled in"),
])
def test_tei_flags_that_mean_nothing_here_are_refused_in_one_line(tiny_embed_artifact, flags, message):
    (line,) = _refusal("--artifacts", str(tiny_embed_artifact), *flags)
    assert line.startswith("bert-serve: error: ") and message in line, line
    if flags[0] == "--dtype":
        assert "bert-compile --precision" in line and "--dtype float16" in line


def test_a_unix_socket_or_metrics_port_that_cannot_be_used_is_refused(tiny_embed_artifact, tmp_path):
    taken_file = tmp_path / "not-a-socket"
    taken_file.write_text("")
    (line,) = _refusal("--artifacts", str(tiny_embed_artifact), "--uds-path", str(taken_file))
    assert f"cannot listen on unix socket {taken_file}" in line
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        (line,) = _refusal("--artifacts", str(tiny_embed_artifact), "--prometheus-port", str(port))
    assert f"cannot serve metrics on 127.0.0.1:{port}" in line


def test_a_stale_unix_socket_is_replaced_and_a_live_one_refused(tmp_path):
    from service.listeners import ListenerError, unix_listener

    path = tmp_path / "s.sock"
    with unix_listener(path) as live:
        live.listen()
        with pytest.raises(ListenerError, match="another server listens on it"):
            unix_listener(path)
    assert path.is_socket()  # left behind, as by a killed server
    with unix_listener(path) as replaced:
        replaced.listen()
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))


def test_tei_names_for_our_flags():
    from service.cli import parse_args

    args = parse_args(["--hostname", "0.0.0.0", "-p", "3000", "--served-model-name", "m", "--json-output",
                       "--disable-spans", "--cors-allow-origin", "a", "--cors-allow-origin", "b"])
    assert (args.host, args.port, args.served_names, args.log_format) == ("0.0.0.0", 3000, ["m"], "json")
    assert args.cors_allow_origin == ["a", "b"] and args.disable_spans is None


def test_traces_url_takes_a_collector_address_or_a_full_url():
    from service.tracing import traces_url

    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://otel.example/custom/v1/traces") == "https://otel.example/custom/v1/traces"


def test_no_tracing_without_an_endpoint(tiny_embed_artifact):
    """Without --otlp-endpoint no tracer exists and OpenTelemetry's SDK and exporter are not even
    loaded (its API is: FastAPI imports it), so no middleware or span runs."""
    probe = ("import sys; from service.app import create_app; from service.settings import Settings; "
             f"app = create_app(Settings(artifacts=[{str(tiny_embed_artifact)!r}])); "
             "assert app.state.runtime.tracing is None; "
             "assert all(m.kwargs.get('tracing') is None for m in app.user_middleware); "
             "loaded = [m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))]; "
             "assert not loaded, loaded")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_teis_environment_variables_set_the_flags_they_set_in_tei():
    """A TEI container's environment carries over; BERT_SERVE_* and flags still win, and HOSTNAME and
    PORT (set by shells and orchestrators) are not read."""
    environ = {"OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTLP_SERVICE_NAME": "tei",
               "CORS_ALLOW_ORIGIN": "http://a,http://b", "PROMETHEUS_PORT": "9100", "MAX_CLIENT_BATCH_SIZE": "8", "AUTO_TRUNCATE": "false", "API_KEY": "k",
               "HOSTNAME": "pod-7f9c", "PORT": "1"}
    settings = Settings.load({"artifacts": [Path("x")]}, environ)
    assert (settings.otlp_endpoint, settings.otlp_service_name, settings.cors_allow_origin) == (
        "http://127.0.0.1:4318", "tei", ["http://a", "http://b"])
    assert (settings.prometheus_port, settings.max_client_batch_size, settings.auto_truncate, settings.api_key) == (
        9100, 8, False, "k")
    assert (settings.host, settings.port) == ("127.0.0.1", 8080)
    ours = Settings.load({"artifacts": [Path("x")], "max_client_batch_size": 4},
                         {**environ, "BERT_SERVE_PROMETHEUS_PORT": "9200"})
    assert (ours.prometheus_port, ours.max_client_batch_size) == (9200, 4)
