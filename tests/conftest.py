"""Shared fixtures: tiny random-weight BERTs saved with save_pretrained, and compiled artifacts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from compile.config import CompileConfig, default_model_dir  # noqa: E402
from loadtest.random_checkpoint import copy_tokenizer as _copy_tokenizer  # noqa: E402,F401  (tests import it)

TINY_LABELS = {0: "negative", 1: "neutral", 2: "positive"}


TINY_SIZES = {"vocab_size": 30522,  # the MiniLM tokenizer's vocabulary, copied next to the weights
              "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
              "max_position_embeddings": 64}


def pytest_collection_modifyitems(items):
    """The files marked slow first (each file's tests in their order): the parallel workers of
    scripts/test.sh take whole files, so the long ones start early and short ones fill the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _tiny_config(**extra):
    from transformers import BertConfig

    return BertConfig(**{**TINY_SIZES, **extra})


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


def save_tiny_sentence_transformer(directory: Path, seed: int, prompts: dict[str, str] | None = None,
                                   config: dict | None = None) -> Path:
    """A 2-layer BertModel with sentence-transformers mean pooling metadata (and prompts, if given)."""
    from loadtest.random_checkpoint import save_sentence_transformer

    return save_sentence_transformer(directory, seed, {**TINY_SIZES, **(config or {})}, prompts)


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    return save_tiny_sentence_transformer(tmp_path_factory.mktemp("tiny-bert"), seed=0)


WHOLE_PANELS = {"hidden_size": 96, "num_attention_heads": 3, "intermediate_size": 192}  # every int8 kernel's


@pytest.fixture(scope="session")
def whole_panels_bert_dir(tmp_path_factory) -> Path:
    """A tiny BERT whose widths are whole weight panels of every int8 kernel (AVX2's 24 columns, VNNI's
    32 and 48), so that int8 quantizes its linears on any CPU: TINY_SIZES' 32 and 64 fit AVX-512's only."""
    return save_tiny_sentence_transformer(tmp_path_factory.mktemp("whole-panels-bert"), seed=0, config=WHOLE_PANELS)


@pytest.fixture(scope="session")
def tiny_classifier_dir(tmp_path_factory) -> Path:
    """A 2-layer BertForSequenceClassification with three named labels."""
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(1)
    directory = tmp_path_factory.mktemp("tiny-classifier")
    config = _tiny_config(
        num_labels=3, id2label=TINY_LABELS, label2id={v: k for k, v in TINY_LABELS.items()},
        architectures=["BertForSequenceClassification"],
    )
    BertForSequenceClassification(config).save_pretrained(directory)
    _copy_tokenizer(directory)
    return directory


def compile_artifact(model: Path, out: Path, buckets: list[str], task: str = "embed", **settings):
    from compile.pipeline import compile_model

    config = CompileConfig(model=model, out=out, buckets=buckets, task=task, max_batch=16,
                           generic_shapes=settings.pop("generic_shapes", ["3x5", "2x11", "5x20"]), **settings)
    return compile_model(config)


def int8_linear_inputs(m, n: int, k: int, kernel, panel: int | None = None) -> list:
    """The placeholders of `int8.int8_matmul_te` for M rows (an int or a var), N outputs and K inputs (the
    activations' dims int64, as Relax writes them), on panels `panel` columns wide (default: the kernel's)."""
    from tvm import te, tirx

    from compile.kernels import int8

    panel = panel or kernel.panel
    return [te.placeholder((m, tirx.IntImm("int64", k)), int8.ACTIVATION, name="xq"),
            te.placeholder((m,), "float32", name="scale"), te.placeholder((m,), "int32", name="zero"),
            te.placeholder((n // panel, k // kernel.group, panel, kernel.group), "int8", name="panels"),
            te.placeholder((n,), "float32", name="weight_scale"), te.placeholder((n,), "int32", name="column_sum")]


def prefetched_addresses(func) -> list:
    """The indices of every address `func` prefetches (compile/kernels/common.prefetch_next_panel)."""
    import tvm
    import tvm_ffi

    prefetch, indices = tvm.ir.Op.get("tirx.prefetch"), []
    tvm_ffi.structural_walk(func, [(tvm.ir.expr.Call, lambda call: indices.append(
        list(call.args[0].args[0].indices)) if call.op.same_as(prefetch) else None)])
    return indices


def prefetch_guards(func) -> list:
    """For every prefetch of `func`, the loop whose first iteration alone issues it (the For of `v` in
    an `if v == 0` around it), or None where no such `if` guards it."""
    import tvm_ffi
    from tvm import tirx

    loops, guards = {}, []
    tvm_ffi.structural_walk(func, [(tirx.For, lambda loop: loops.update({loop.loop_var: loop}))])

    def guard(branch):
        condition = branch.condition
        first = (isinstance(condition, tirx.EQ) and isinstance(condition.b, tirx.IntImm)
                 and int(condition.b) == 0 and isinstance(condition.a, tirx.Var))
        if first:  # other branches around prefetches (a claimed loop's) guard every iteration alike
            guards.extend([loops.get(condition.a)] * len(prefetched_addresses(branch.then_case)))

    tvm_ffi.structural_walk(func, [(tirx.IfThenElse, guard)])
    return guards + [None] * (len(prefetched_addresses(func)) - len(guards))


def key_padding_bias(seq: int, length: int):
    """The additive attention bias [1, 1, 1, seq] of one sequence whose keys from `length` on are
    padding (float32's least value, as the wrapper's mask gives them)."""
    import numpy as np

    masked = np.finfo(np.float32).min
    return np.where(np.arange(seq) < length, 0.0, masked).astype(np.float32).reshape(1, 1, 1, seq)


def attention_heads(qkv, heads: int, head_size: int) -> list:
    """Q, K and V of one sequence side by side in `qkv` [seq, 3 x hidden], each as [1, heads, seq,
    head_size] torch tensors, as transformers hands them to its attention."""
    import torch

    hidden = heads * head_size
    return [torch.from_numpy(qkv[:, i * hidden:(i + 1) * hidden]).reshape(1, -1, heads, head_size).transpose(1, 2)
            for i in range(3)]


def int8_weight_operands(quantized, kernel, panel: int | None = None) -> tuple:
    """(panels, column sums) of int8 weights [N, K] in `kernel`'s layout, `panel` columns a panel (default:
    the kernel's), as the int8 pass writes them."""
    import numpy as np

    n, k = quantized.shape
    panel = panel or kernel.panel
    panels = quantized.reshape(n // panel, panel, k // kernel.group, kernel.group).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(panels), quantized.astype(np.int32).sum(axis=1).astype(np.int32)


def least_cosine_to_pytorch(model, checkpoint: Path, shapes: list[tuple[int, int]]) -> float:
    """The least cosine of a loaded artifact's embeddings (`model`, artifact.loader) to the PyTorch
    fp32 model of `checkpoint`, over random token rows of each (batch, seq) of `shapes`."""
    import numpy as np
    import torch

    from compile.checkpoint import example_inputs, inspect_checkpoint, load_wrapper

    wrapper = load_wrapper(inspect_checkpoint(checkpoint, "embed"), "embed")
    least = 1.0
    for batch, seq in shapes:
        inputs = example_inputs(batch, seq, model.manifest.model.vocab_size, seed=batch)
        served = model.run(inputs[0].numpy(), inputs[1].numpy()).output
        with torch.no_grad():
            expected = wrapper(*inputs).numpy()
        cosine = np.sum(served * expected, 1) / np.linalg.norm(served, axis=1) / np.linalg.norm(expected, axis=1)
        least = min(least, float(cosine.min()))
    return least


def with_latencies(artifact: Path, out: Path, latencies: dict[tuple[int, int], float]) -> Path:
    """A copy of a padded `artifact` whose buckets' recorded latencies are `latencies` ((batch, seq)
    -> ms): what routes a batch then depends on the test, not on how busy the machine was when
    the artifact was compiled and timed."""
    import json
    import shutil

    shutil.copytree(artifact, out)
    data = json.loads((out / "manifest.json").read_text())
    for bucket in data["buckets"]:
        bucket["latency_ms"] = latencies[bucket["batch"], bucket["seq"]]
    (out / "manifest.json").write_text(json.dumps(data))
    return out


# The tiny artifact's buckets timed as an idle machine times them: a bigger bucket takes longer.
TINY_LATENCIES = {(1, 8): 1.0, (2, 16): 1.5, (4, 16): 2.0}


def error_of(response) -> tuple[str, str]:
    """(message, type) of an error answer, whose body must have its route's shape: TEI's
    `{"error", "error_type"}`, or OpenAI's `{"error": {"message", "type", "param", "code"}}` on OpenAI's routes."""
    path = response.request.url.path
    body = response.json()
    if path in ("/embeddings", "/models") or path.startswith(("/v1/", "/models/")):
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        return body["error"]["message"], body["error"]["type"]
    assert set(body) == {"error", "error_type"}, body
    return body["error"], body["error_type"]


def server_refusal(artifacts: Path) -> list[str]:
    """Start `python -m service` on `artifacts`, which it must refuse before listening (exit 2):
    the lines it wrote to stderr."""
    result = subprocess.run([sys.executable, "-m", "service", "--artifacts", str(artifacts), "--port", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.returncode, result.stderr)
    return result.stderr.strip().splitlines()


@pytest.fixture(scope="session")
def tiny_embed_artifact(tiny_bert_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("artifacts") / "tiny-embed"
    compile_artifact(tiny_bert_dir, out, ["1x8", "2x16", "4x16"])
    return out


@pytest.fixture(scope="session")
def tiny_classify_artifact(tiny_classifier_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("artifacts") / "tiny-classify"
    compile_artifact(tiny_classifier_dir, out, ["1x8", "4x16"], task="classify")
    return out


@pytest.fixture(scope="session")
def minilm_artifact(minilm_dir, tmp_path_factory) -> Path:
    """The real all-MiniLM-L6-v2, compiled for this CPU with two small buckets."""
    out = tmp_path_factory.mktemp("artifacts") / "minilm"
    compile_artifact(minilm_dir, out, ["1x16", "4x32"], generic_shapes=["3x20", "2x45", "5x9"])
    return out


@pytest.fixture(scope="session")
def minilm_packed_artifact(minilm_dir, tmp_path_factory) -> Path:
    """The real all-MiniLM-L6-v2 with the packed layout, two sequence bounds."""
    out = tmp_path_factory.mktemp("artifacts") / "minilm-packed"
    compile_artifact(minilm_dir, out, ["packed-16", "packed-64"], layout="packed",
                     generic_shapes=["3x20", "2x45", "5x9"])
    return out


@pytest.fixture(scope="session")
def serve(tmp_path_factory):
    """Start `python -m service` (or `module`) on a free loopback port: a context manager yielding, once /ready
    says 200, a namespace with `url`, `process` and `log` (the server's output file)."""
    import itertools

    from loadtest.servers import running_server

    logs = tmp_path_factory.mktemp("server-logs")
    counter = itertools.count()

    def start(artifacts, *args, env=None, ready_headers=None, timeout=180.0, module="service"):
        return running_server(artifacts, "--log-level", "warning", *args, log_path=logs / f"server-{next(counter)}.log",
                              env=env, ready_headers=ready_headers, timeout=timeout, module=module)

    return start
