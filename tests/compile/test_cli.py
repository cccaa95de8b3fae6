"""The CLI's bad inputs: a one-line error, exit code 2, nothing written."""

import json
from pathlib import Path

import pytest

from artifact.manifest import MODEL_TYPES
from tests.support.commands import REPO, run_cli

pytestmark = pytest.mark.slow  # collected first: see conftest.py


@pytest.fixture
def gpt2_dir(tmp_path):
    directory = tmp_path / "gpt2"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return directory


@pytest.mark.parametrize(
    "make_args,message",
    [
        (lambda t, m, g: ["--model", str(t / "missing")], "model directory not found"),
        (lambda t, m, g: ["--model", str(g)], "not a BERT checkpoint"),
        (lambda t, m, g: ["--model", str(m), "--buckets", "8by128"], "malformed bucket"),
        (lambda t, m, g: ["--model", str(m), "--buckets", "0x16"], "zero dimension"),
        (lambda t, m, g: ["--model", str(m), "--buckets", "1x100"], "max_position_embeddings (64)"),
        (lambda t, m, g: ["--model", str(m), "--task", "classify"], "not a BertForSequenceClassification"),
        (lambda t, m, g: ["--model", str(m), "--config", str(t / "nope.yaml")], "config file not found"),
        (lambda t, m, g: ["--model", str(m), "--config", str(REPO / "README.md")],
         "README.md is not valid YAML: mapping values are not allowed here (line "),
        (lambda t, m, g: ["--model", str(m), "--layout", "packed", "--buckets", "8x16"],
         "buckets of layout packed are packed-SEQ"),
        (lambda t, m, g: ["--model", str(m), "--buckets", "packed-16"], "buckets of layout padded are BATCHxSEQ"),
        (lambda t, m, g: ["--model", str(m), "--buckets", "1x8,packed-16"], "mix padded"),
        (lambda t, m, g: ["--model", str(m), "--layout", "packed", "--buckets", "packed-100"],
         "max_position_embeddings (64)"),
        (lambda t, m, g: ["--model", str(m), "--layout", "packed", "--target", "cuda"],
         "packed is built for target cpu"),
        (lambda t, m, g: ["--model", str(m), "--layout", "packed", "--sparsity", "0.5"],
         "does not combine with sparsity"),
        (lambda t, m, g: ["--model", str(m), "--task", "classify", "--pooling", "mean"],
         "pooling mean is for task embed: a classify head reads its own token"),
        (lambda t, m, g: ["--model", str(m), "--attention-products", "bf16"],
         "attention_products bf16 is for bf16 and int8 linears"),
        (lambda t, m, g: ["--model", str(m), "--precision", "int8", "--attention-products", "bf16", "--buckets",
                          "1x8", "--mcpu", "x86-64-v3"],
         "--attention-products bf16 needs a CPU with AVX512_BF16; mcpu x86-64-v3"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, tiny_bert_dir, gpt2_dir, make_args, message):
    out = tmp_path / "out"
    result = run_cli(*make_args(tmp_path, tiny_bert_dir, gpt2_dir), "--out", str(out))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_a_checkpoint_that_needs_remote_code_exits_2_with_one_line(tmp_path):
    """Jina's BERT says model_type bert, but its auto_map runs a BERT of its own (ALiBi): refused, not
    compiled as the BERT transformers implements."""
    directory = tmp_path / "jina"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["JinaBertForMaskedLM"],
        "auto_map": {"AutoConfig": "jinaai/jina-bert-implementation--configuration_bert.JinaBertConfig",
                     "AutoModel": "jinaai/jina-bert-implementation--modeling_bert.JinaBertModel"}}))
    result = run_cli("--model", str(directory), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and result.stderr.strip() == (
        f"bert-compile: error: {directory} needs trust_remote_code: its config.json maps model_type 'bert' to code of "
        f"its own (JinaBertConfig, JinaBertModel), which is not compiled; supported: {', '.join(MODEL_TYPES)}, as "
        "transformers implements them"), result.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_task_exits_2(tmp_path):
    result = run_cli("--task", "summarize", "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "invalid choice" in result.stderr
    assert not (tmp_path / "out").exists()


def test_unwritable_out_exits_2(tmp_path, tiny_bert_dir):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = run_cli("--model", str(tiny_bert_dir), "--buckets", "1x8", "--out", str(blocker / "out"))
    assert result.returncode == 2
    assert "not writable" in result.stderr
    assert blocker.read_text() == "not a directory"


def test_config_file_and_flag_override(tmp_path, tiny_bert_dir):
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {tiny_bert_dir}\nbuckets: ['2x8']\nmax_batch: 8\n"
                      "generic_shapes: ['3x5', '1x9', '2x3']\n")
    out = tmp_path / "out"
    result = run_cli("--config", str(config), "--buckets", "1x8,2x16", "--out", str(out), "--no-validate")
    assert result.returncode == 0, result.stderr
    assert "NOT validated: --no-validate" in result.stderr.splitlines()
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(b["batch"], b["seq"]) for b in manifest["buckets"]] == [(1, 8), (2, 16)]
    assert manifest["generic"]["max_batch"] == 8


def test_unknown_config_key_exits_2(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("bukets: ['1x8']\n")
    result = run_cli("--config", str(config), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "bukets" in result.stderr


@pytest.mark.parametrize("flags,message", [(["--dtype", "float16"], "float16 is supported for target cuda only"),
                                           (["--cuda-graph"], "cuda_graph needs target cuda"),
                                           (["--precision", "int8", "--target", "cuda"],
                                            "precision int8 is built for target cpu, without sparsity"),
                                           (["--precision", "bf16", "--sparsity", "0.5"],
                                            "precision bf16 is built for target cpu, without sparsity")])
def test_cuda_only_options_on_cpu_exit_2(tmp_path, flags, message):
    result = run_cli(*flags, "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert message in result.stderr


def test_a_checkpoints_artifact_goes_beside_the_bundled_models_by_default(tmp_path, tiny_bert_dir):
    """Without `out`, a checkpoint's artifact is named after its directory: a compile of another
    model does not replace artifacts/minilm-cpu, the artifact scripts/serve.sh serves."""
    from compile.config import CompileConfig, load_config

    assert CompileConfig().out == Path("artifacts/minilm-cpu")
    assert CompileConfig(model=tiny_bert_dir).out == Path("artifacts") / tiny_bert_dir.name
    beside = Path("artifacts") / tiny_bert_dir.name
    assert load_config(REPO / "configs/default.yaml", {"model": tiny_bert_dir}).out == beside
    assert load_config(REPO / "configs/default.yaml", {}).out == Path("artifacts/minilm-cpu")
    assert CompileConfig(model=tiny_bert_dir, out=tmp_path / "x").out == tmp_path / "x"


def test_sigterm_inside_a_tvm_callback_exits_143_without_a_traceback(tmp_path, tiny_bert_dir, monkeypatch, capsys):
    """A SIGTERM handled while TVM runs a Python callback (a pass, a packed function) comes back out
    of TVM as a RuntimeError, not the SystemExit the handler raised: the compile still ends as the
    signal asked, quietly, with nothing written."""
    import os
    import signal
    import time

    import tvm_ffi

    import compile.pipeline
    from compile import cli

    @tvm_ffi.register_global_func("tests.sigterm_inside_a_callback", override=True)
    def terminated_inside():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler runs here, inside the callback

    def compile_model(config, progress):
        tvm_ffi.get_global_func("tests.sigterm_inside_a_callback")()

    monkeypatch.setattr(compile.pipeline, "compile_model", compile_model)
    monkeypatch.setattr(cli, "_terminated_by", None)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        status = cli.main(["--model", str(tiny_bert_dir), "--buckets", "1x8", "--out", str(tmp_path / "out"),
                           "--quiet"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert status == 128 + signal.SIGTERM
    assert capsys.readouterr().err == ""
    assert not (tmp_path / "out").exists()
