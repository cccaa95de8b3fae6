"""Fixtures (tiny random-weight BERTs saved with save_pretrained, the real MiniLM, compiled artifacts, a
server) and hooks: slow files first, and the `requires` marker (tests/support/capabilities.py).
Code the tests share lives in tests/support/, which they import; nothing imports this file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from compile.config import default_model_dir  # noqa: E402
from tests.support.artifacts import compile_artifact, shared_directory  # noqa: E402
from tests.support.capabilities import FeatureRecord  # noqa: E402
from tests.support.checkpoints import (  # noqa: E402
    WHOLE_PANELS,
    save_planted_checkpoint,
    save_tiny_classifier,
    save_tiny_sentence_transformer,
)


def pytest_configure(config):
    config.pluginmanager.register(FeatureRecord(), "cpu-feature-record")


def pytest_collection_modifyitems(items):
    """The files marked slow first (each file's tests in their order): the parallel workers of
    scripts/test.sh take whole files, so the long ones start early and short ones fill the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="session")
def minilm_imported(minilm_dir):
    """The real MiniLM exported and imported once (weights still parameters)."""
    from compile.checkpoint import inspect_checkpoint, load_wrapper
    from compile.importer import export_and_import

    info = inspect_checkpoint(minilm_dir, "embed")
    return export_and_import(load_wrapper(info, "embed"), 16, info.max_seq, info.config["vocab_size"])


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    """Shared by the run's workers, as the artifacts compiled from it are (their manifests name it)."""
    return shared_directory(tmp_path_factory, "tiny-bert", lambda path: save_tiny_sentence_transformer(path, seed=0))


@pytest.fixture(scope="session")
def whole_panels_bert_dir(tmp_path_factory) -> Path:
    """A tiny BERT whose widths are whole weight panels of every int8 kernel (AVX2's 24 columns, VNNI's
    32 and 48), so that int8 quantizes its linears on any CPU: TINY_SIZES' 32 and 64 fit AVX-512's only."""
    return save_tiny_sentence_transformer(tmp_path_factory.mktemp("whole-panels-bert"), seed=0, config=WHOLE_PANELS)


@pytest.fixture(scope="session")
def tiny_classifier_dir(tmp_path_factory) -> Path:
    """A 2-layer BertForSequenceClassification with three named labels (shared by the run's workers)."""
    return shared_directory(tmp_path_factory, "tiny-classifier", save_tiny_classifier)


@pytest.fixture(scope="session")
def outlier_checkpoint(tmp_path_factory) -> Path:
    """A tiny embedder with an outlier activation channel, which smoothing removes."""
    return save_planted_checkpoint(tmp_path_factory.mktemp("outlier"), "outlier")


@pytest.fixture(scope="session")
def cancelling_checkpoint(tmp_path_factory) -> Path:
    """A tiny embedder with two huge channels that cancel in a product, which keeps a linear out of int8."""
    return save_planted_checkpoint(tmp_path_factory.mktemp("cancelling"), "cancelling")


@pytest.fixture(scope="session")
def unseen_checkpoint(tmp_path_factory) -> Path:
    """A tiny embedder whose outlier channels fire only on tokens that no shipped sentence holds."""
    return save_planted_checkpoint(tmp_path_factory.mktemp("unseen"), "unseen")


# The session's artifacts are compiled once per run, not once per worker: read-only, shared by every file.
@pytest.fixture(scope="session")
def tiny_embed_artifact(tiny_bert_dir, tmp_path_factory) -> Path:
    return shared_directory(tmp_path_factory, "tiny-embed",
                            lambda out: compile_artifact(tiny_bert_dir, out, ["1x8", "2x16", "4x16"]))


@pytest.fixture(scope="session")
def tiny_classify_artifact(tiny_classifier_dir, tmp_path_factory) -> Path:
    return shared_directory(tmp_path_factory, "tiny-classify",
                            lambda out: compile_artifact(tiny_classifier_dir, out, ["1x8", "4x16"], task="classify"))


@pytest.fixture(scope="session")
def tiny_tokens_artifact(tiny_bert_dir, tmp_path_factory) -> Path:
    """The tiny BERT with `pooling none` (every token's final hidden state, /embed_all), padded."""
    return shared_directory(tmp_path_factory, "tokens-padded",
                            lambda out: compile_artifact(tiny_bert_dir, out, ["1x8", "4x16"], pooling="none"))


@pytest.fixture(scope="session")
def minilm_artifact(minilm_dir, tmp_path_factory) -> Path:
    """The real all-MiniLM-L6-v2, compiled for this CPU with two small buckets."""
    return shared_directory(tmp_path_factory, "minilm", lambda out: compile_artifact(
        minilm_dir, out, ["1x16", "4x32"], generic_shapes=["3x20", "2x45", "5x9"]))


@pytest.fixture(scope="session")
def minilm_packed_artifact(minilm_dir, tmp_path_factory) -> Path:
    """The real all-MiniLM-L6-v2 with the packed layout, one sequence bound (several bounds are
    tests/test_packed_layout.py's)."""
    return shared_directory(tmp_path_factory, "minilm-packed", lambda out: compile_artifact(
        minilm_dir, out, ["packed-32"], layout="packed", generic_shapes=["3x20", "2x45", "5x9"]))


@pytest.fixture(scope="session")
def serve(tmp_path_factory):
    """Start `python -m service` (or `module`) on a free loopback port: a context manager yielding, once /ready
    says 200, a namespace with `url`, `process` and `log` (the server's output file)."""
    import contextlib
    import itertools

    from loadtest.servers import free_port, running_server

    logs = tmp_path_factory.mktemp("server-logs")
    counter = itertools.count()

    @contextlib.contextmanager
    def start(artifacts, *args, env=None, ready_headers=None, timeout=180.0, module="service", grpc=False):
        """`grpc`: also serve gRPC on a free port, reached at the namespace's `grpc` address."""
        port = free_port() if grpc else None
        with running_server(artifacts, "--log-level", "warning", *args, *(("--grpc-port", str(port)) if grpc else ()),
                            log_path=logs / f"server-{next(counter)}.log", env=env, ready_headers=ready_headers,
                            timeout=timeout, module=module) as running:
            if grpc:
                running.grpc = f"127.0.0.1:{port}"
            yield running

    return start
