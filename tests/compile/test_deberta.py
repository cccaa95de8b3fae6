"""DeBERTa-v2/v3 through the same pipeline as BERT: tiny random-weight checkpoints (layer-norm scales not all
1, the relative position table scaled up so that its disentangled terms move the softmax) with a SentencePiece
model trained here and shipped as spm.model alone, as DeBERTa-v3 ships it; compared with transformers in both
layouts on inputs longer than the 8 position buckets: a v3-style embedder (shared attention keys, a normed
relative table, no absolute positions) and a v2-style classifier (its own position projections, token types)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from artifact.loader import load_artifact
from compile.checkpoint import inspect_checkpoint, load_wrapper
from compile.errors import CompileError
from compile.tokenizer import fast_tokenizer_file
from compile.validate import DRIFT_SENTENCES
from loadtest.random_checkpoint import DEBERTA_SPECIALS, deberta_spm_model
from service.tokenization import TextTokenizer
from tests.support.artifacts import compile_artifact
from tests.support.checkpoints import TINY_LABELS, scale_layer_norms
from tests.support.families import assert_wrappers_compute_what_transformers_does, transformers_output

pytestmark = pytest.mark.slow  # collected first: see conftest.py

MAX_SEQ = 48  # six times the position buckets' range
LONG = " ".join(DRIFT_SENTENCES * 2)  # longer than MAX_SEQ tokens: truncated to it
TEXTS = [*DRIFT_SENTENCES[:3], "a", LONG]
PAIRS = [("the cat plays a guitar", DRIFT_SENTENCES[0]), ("a", DRIFT_SENTENCES[1]), (DRIFT_SENTENCES[2], LONG)]
STYLES = {  # the embedder as DeBERTa-v3 is configured, the classifier as DeBERTa-v2 (base/large) is
    "embed": dict(share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False, type_vocab_size=0,
                  pos_att_type=["p2c", "c2p"]),
    "classify": dict(share_att_key=False, position_biased_input=True, type_vocab_size=2, pos_att_type=["c2p", "p2c"],
                     num_labels=3, id2label=TINY_LABELS, label2id={v: k for k, v in TINY_LABELS.items()}),
}


def make_checkpoint(directory: Path, task: str) -> Path:
    """A 2-layer random-weight DeBERTa-v2 checkpoint; for embed a sentence-transformers one (mean pooling)."""
    from transformers import AutoModel, AutoModelForSequenceClassification, DebertaV2Config

    directory.mkdir()
    (directory / "spm.model").write_bytes(deberta_spm_model(DRIFT_SENTENCES * 4))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "DebertaV2Tokenizer",
                                                                 "do_lower_case": False, "model_max_length": MAX_SEQ,
                                                                 **DEBERTA_SPECIALS}))
    torch.manual_seed(len(task))
    config = DebertaV2Config(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=128, max_position_embeddings=MAX_SEQ, initializer_range=0.2,
                             relative_attention=True, position_buckets=8, max_relative_positions=MAX_SEQ,
                             pad_token_id=0, **STYLES[task])
    model = (AutoModelForSequenceClassification if task == "classify" else AutoModel).from_config(config)
    scale_layer_norms(model, seed=len(task))
    with torch.no_grad():
        model.base_model.encoder.rel_embeddings.weight.mul_(5.0)  # moves the softmax as much as Q K^T does
    model.save_pretrained(directory)
    if task == "embed":
        (directory / "modules.json").write_text(json.dumps(
            [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
             {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (directory / "1_Pooling").mkdir()
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deberta")
    return {task: make_checkpoint(root / task, task) for task in ("embed", "classify")}


def _batch(directory: Path, task: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    inputs = [list(pair) for pair in zip(*PAIRS)] if task == "classify" else [TEXTS]
    return tokenizer(*inputs, padding=True, truncation=True, max_length=MAX_SEQ, return_tensors="pt")


@pytest.mark.parametrize("task", ["embed", "classify"])
def test_wrappers_compute_what_transformers_does(checkpoints, task):
    """The padded wrapper equals the transformers model (classify: on pairs, through its ContextPooler); the
    packed wrapper, whose disentangled terms are each sequence's own, equals the padded one."""
    directory = checkpoints[task]
    info = inspect_checkpoint(directory, task)
    assert info.max_seq == MAX_SEQ and info.pooling == ("mean" if task == "embed" else "none")
    batch = _batch(directory, task)
    assert batch["input_ids"].shape[1] == MAX_SEQ
    assert_wrappers_compute_what_transformers_does(load_wrapper(info, task), directory, task, batch)


def test_the_spm_model_is_served_as_transformers_tokenizes(checkpoints):
    """DeBERTa-v3 ships spm.model and no tokenizer.json: the artifact's tokenizer is the one transformers
    builds from it, [CLS] A [SEP] B [SEP] for pairs."""
    from transformers import AutoTokenizer

    directory = checkpoints["classify"]
    expected = AutoTokenizer.from_pretrained(directory)
    served = TextTokenizer(fast_tokenizer_file(directory), 512, len(expected))
    items = [*TEXTS, *PAIRS]
    assert [e.ids.tolist() for e in served.encode(items, truncation=None)] == [
        expected(*([item] if isinstance(item, str) else item))["input_ids"] for item in items]


def test_compiled_packed_embedder_matches_transformers(checkpoints, tmp_path):
    """Compiled packed in fp32: every layer's attention fused with its disentangled terms as the score bias,
    validated against PyTorch, and run on inputs up to MAX_SEQ tokens: transformers' mean-pooled states."""
    directory = checkpoints["embed"]
    manifest, _ = compile_artifact(directory, tmp_path / "artifact", [f"packed-{MAX_SEQ}"], layout="packed",
                                   precision="fp32", generic_shapes=["3x5"])
    assert manifest.validated and manifest.model.model_type == "deberta-v2" and manifest.pooling == "mean"
    assert manifest.passes.strategies["concat"].attention_fused == 2  # one fused kernel per layer
    assert manifest.generic.takes_bounded_batches  # its bounds compute the terms at the bound
    batch = _batch(directory, "embed")
    served = load_artifact(tmp_path / "artifact").run(batch["input_ids"].numpy(), batch["attention_mask"].numpy()).output
    expected = transformers_output(directory, "embed", batch).numpy()
    cosines = np.sum(served * expected, 1) / np.linalg.norm(served, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosines.min() >= 0.9999
    np.testing.assert_allclose(served, expected, atol=1e-4)


def test_padded_attention_fuses_with_its_disentangled_terms(checkpoints):
    """The padded layout's graph (the compile above is packed): each layer's softmax and both its matmuls
    become one fused kernel call that adds the layer's c2p + p2c terms."""
    from tvm import relax

    from compile.build import make_target
    from compile.capabilities import KernelConfig
    from compile.importer import export_and_import
    from compile.passes.fuse_attention import fuse_attention_in
    from compile.passes.strategy import apply_strategy

    info = inspect_checkpoint(checkpoints["classify"], "classify")
    imported = export_and_import(load_wrapper(info, "classify"), 4, MAX_SEQ, info.config["vocab_size"], "padded")
    after, fused = fuse_attention_in(apply_strategy(imported.mod, "concat"),
                                     KernelConfig.of(make_target("cpu", mcpu="x86-64-v4")))
    softmaxes = []
    relax.analysis.post_order_visit(after["main"].body, lambda e: softmaxes.append(e) if isinstance(
        e, relax.Call) and getattr(e.op, "name", "") == "relax.nn.softmax" else None)
    assert fused == 2 and not softmaxes


@pytest.mark.parametrize("change,pooling,reason", [
    ({"conv_kernel_size": 3}, "auto", "convolution after the first layer"),
    ({"pos_att_type": ["c2p", "p2p"]}, "auto", r"pos_att_type \['c2p', 'p2p'\] is not compiled"),
    ({"architectures": ["DebertaV2ForMaskedLM"]}, "splade", r"masked-LM head is not compiled \(--task sparse\)"),
])
def test_unsupported_variants_are_refused_in_one_line(checkpoints, tmp_path, change, pooling, reason):
    directory = tmp_path / "variant"
    directory.mkdir()
    for source in checkpoints["embed"].iterdir():
        if source.is_file():
            (directory / source.name).write_bytes(source.read_bytes())
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CompileError, match=reason) as refused:
        inspect_checkpoint(directory, "embed", pooling)
    assert "\n" not in str(refused.value)


def test_the_benchmarks_deberta_v3_checkpoint_runs_as_transformers_runs_it(tmp_path):
    """`python -m loadtest.random_checkpoint --family deberta-v2` (the benchmark's deberta-v3-base geometry,
    here tiny) writes a checkpoint the compile reads: its spm.model tokenizes, and the wrapper computes what
    transformers does."""
    from loadtest.random_checkpoint import main

    directory = tmp_path / "v3"
    assert main(["--out", str(directory), "--family", "deberta-v2", "--layers", "1", "--hidden", "32", "--heads", "2",
                 "--intermediate", "64", "--max-positions", "64"]) == 0
    info = inspect_checkpoint(directory, "embed")
    assert (info.config["model_type"], info.max_seq, info.pooling, info.config["vocab_size"]) == (
        "deberta-v2", 64, "mean", 128100)
    assert_wrappers_compute_what_transformers_does(load_wrapper(info, "embed"), directory, "embed",
                                                   _batch(directory, "embed"))
