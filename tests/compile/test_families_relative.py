"""ELECTRA and MPNet through the same pipeline as BERT: tiny random-weight checkpoints (layer-norm
scales not all 1, MPNet's relative position table scaled up so that it moves the softmax) with
WordPiece tokenizers built here, compared with transformers and sentence-transformers in both
layouts; MPNet's inputs are longer than its 128-position bucket range."""

from __future__ import annotations

import json
from pathlib import Path
from string import ascii_lowercase

import numpy as np
import pytest
import torch

from artifact.loader import load_artifact
from compile.checkpoint import inspect_checkpoint, load_wrapper
from compile.validate import DRIFT_SENTENCES
from tests.support.artifacts import compile_artifact
from tests.support.checkpoints import TINY_LABELS
from tests.support.families import assert_wrappers_compute_what_transformers_does

pytestmark = pytest.mark.slow  # collected first: see conftest.py

SENTENCES = DRIFT_SENTENCES  # what the tokenizers' vocabulary is made of
MAX_SEQ = 160  # past MPNet's 128-position bucket range
LONG = " ".join(SENTENCES * 2)  # longer than MAX_SEQ tokens: truncated to it
TEXTS = [*SENTENCES[:3], "a", LONG]
PAIRS = [("the cat plays a guitar", SENTENCES[0]), ("a", SENTENCES[1]), (SENTENCES[2], LONG)]
WORDS = sorted({w.strip(".?").lower() for s in SENTENCES for w in s.split()} | set(ascii_lowercase))


def _tokenizer(family: str):
    """A WordPiece tokenizer of the family's kind (MPNet's `<s>` / `</s>`, ELECTRA's BERT tokens)."""
    from transformers import ElectraTokenizer, MPNetTokenizer

    pieces = [".", "?", "-", *WORDS, *(f"##{c}" for c in ascii_lowercase)]
    if family == "mpnet":
        specials = ["<s>", "<pad>", "</s>", "<unk>", "[UNK]", "<mask>"]
        return MPNetTokenizer(vocab={token: i for i, token in enumerate([*specials, *pieces])})
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    return ElectraTokenizer(vocab={token: i for i, token in enumerate([*specials, *pieces])})


def _config(family: str, vocab_size: int, **extra):
    from transformers import ElectraConfig, MPNetConfig

    sizes = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, **extra)
    if family == "mpnet":
        return MPNetConfig(max_position_embeddings=MAX_SEQ + 2, **sizes)
    return ElectraConfig(embedding_size=16, max_position_embeddings=MAX_SEQ, **sizes)  # embeddings projected up


def make_checkpoint(directory: Path, family: str, task: str = "embed") -> Path:
    """A 2-layer random-weight checkpoint of `family`; for embed a sentence-transformers one (mean pooling)."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    torch.manual_seed(sum(map(ord, family + task)))
    tokenizer = _tokenizer(family)
    if task == "classify":
        model = AutoModelForSequenceClassification.from_config(_config(
            family, len(tokenizer), num_labels=3, id2label=TINY_LABELS, label2id={v: k for k, v in TINY_LABELS.items()}))
    else:
        model = AutoModel.from_config(_config(family, len(tokenizer)))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "LayerNorm.weight" in name or "layer_norm.weight" in name:
                parameter.add_(torch.rand_like(parameter) - 0.5)
            if "relative_attention_bias" in name:
                parameter.mul_(100.0)  # from the initializer's 0.02 to scores' scale
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if task == "embed":
        (directory / "modules.json").write_text(json.dumps(
            [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
             {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ}))
        (directory / "1_Pooling").mkdir()
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("relative-families")
    return {(family, task): make_checkpoint(root / f"{family}-{task}", family, task)
            for family in ("mpnet", "electra") for task in ("embed", "classify")}


def _batch(directory: Path, task: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    inputs = ([list(pair) for pair in zip(*PAIRS)] if task == "classify" else [TEXTS])
    return tokenizer(*inputs, padding=True, truncation=True, max_length=MAX_SEQ, return_tensors="pt")


@pytest.mark.parametrize("family", ["mpnet", "electra"])
@pytest.mark.parametrize("task", ["embed", "classify"])
def test_wrappers_compute_what_transformers_does(checkpoints, family, task):
    """The padded wrapper equals the transformers model fed as transformers feeds it (classify: on
    (query, passage) pairs, as a reranker reads them); the packed wrapper equals the padded one."""
    directory = checkpoints[family, task]
    info = inspect_checkpoint(directory, task)
    assert info.max_seq == MAX_SEQ
    batch = _batch(directory, task)
    assert batch["input_ids"].shape[1] == MAX_SEQ
    assert_wrappers_compute_what_transformers_does(load_wrapper(info, task), directory, task, batch)


def test_mpnet_on_pytorchs_fused_attention_computes_what_its_eager_attention_does(checkpoints):
    """transformers has no SDPA attention for MPNet: the PyTorch peer of the benchmarks and the torch
    backend get one, the relative position bias and the mask as its additive mask."""
    from transformers.models.mpnet.modeling_mpnet import MPNetSelfAttention

    info = inspect_checkpoint(checkpoints["mpnet", "classify"], "classify")
    eager, sdpa = (load_wrapper(info, "classify", attention=attention) for attention in ("eager", "sdpa"))
    assert all(type(m).forward is not m.forward for m in sdpa.modules() if isinstance(m, MPNetSelfAttention))
    batch = _batch(checkpoints["mpnet", "classify"], "classify")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    inputs = (ids, mask, torch.zeros_like(ids), torch.arange(ids.shape[1]).expand_as(ids))
    with torch.no_grad():
        np.testing.assert_allclose(sdpa(*inputs).numpy(), eager(*inputs).numpy(), atol=1e-5)


def test_mpnets_score_bias_is_its_relative_positions_in_the_last_bucket_past_128():
    """What every MPNet layer adds: per head, the table's entry of bucket(j - i); past 128 positions
    apart, its last bucket (16 - 1 each way)."""
    from transformers import MPNetConfig, MPNetModel

    from compile.families import FAMILIES

    torch.manual_seed(0)
    model = MPNetModel(MPNetConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=8, max_position_embeddings=MAX_SEQ + 2))
    bias = FAMILIES["mpnet"].score_bias(model, torch.zeros(3, MAX_SEQ))
    table = model.encoder.relative_attention_bias.weight.detach()
    assert bias.shape == (1, 2, MAX_SEQ, MAX_SEQ)
    assert torch.equal(bias[0, :, 0, 150], table[31]) and torch.equal(bias[0, :, 0, 128], table[31])
    assert torch.equal(bias[0, :, 150, 0], table[15]) and torch.equal(bias[0, :, 5, 5], table[0])
    assert torch.equal(bias[0, :, 10, 13], table[16 + 3])


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("layout,precision", [
    ("packed", "fp32"), pytest.param("padded", "bf16", marks=pytest.mark.requires("avx512_bf16"))])
def test_compiled_mpnet_embeddings_match_sentence_transformers(checkpoints, tmp_path, layout, precision):
    """Compiled (attention fused with the relative position table, Q/K/V combined, validated against
    PyTorch) and run on inputs up to MAX_SEQ tokens: sentence-transformers' embeddings, to 0.9999 in
    fp32 and 0.999 in bf16."""
    from sentence_transformers import SentenceTransformer

    family = "mpnet"
    directory = checkpoints[family, "embed"]
    buckets = {"packed": [f"packed-{MAX_SEQ}"], "padded": [f"2x{MAX_SEQ}"]}[layout]
    manifest, _ = compile_artifact(directory, tmp_path / "artifact", buckets, layout=layout, precision=precision,
                                   generic_shapes=["3x5"])
    assert manifest.validated and manifest.model.model_type == family and manifest.pooling == "mean"
    assert manifest.passes.strategies["concat"].attention_fused == 2  # one fused kernel per layer
    assert manifest.passes.strategies["concat"].after.matmul == 2 * 6  # Q, K, V combined in each layer
    batch = _batch(directory, "embed")
    model = load_artifact(tmp_path / "artifact")
    served = model.run(batch["input_ids"].numpy(), batch["attention_mask"].numpy()).output
    expected = SentenceTransformer(str(directory), device="cpu").encode(TEXTS)
    assert _cosines(served, expected).min() >= (0.9999 if precision == "fp32" else 0.999)


def test_compiled_electra_reranker_matches_transformers(checkpoints, tmp_path):
    """A cross-encoder on (query, passage) pairs, packed, fp32: transformers' logits, through ELECTRA's
    embedding projection and its classification head (token 0, dense, GELU, out_proj)."""
    from transformers import AutoModelForSequenceClassification

    directory = checkpoints["electra", "classify"]
    manifest, _ = compile_artifact(directory, tmp_path / "artifact", [f"packed-{MAX_SEQ}"], task="classify",
                                   layout="packed", generic_shapes=["3x5"])
    assert manifest.labels == list(TINY_LABELS.values()) and manifest.validated
    assert manifest.passes.strategies["concat"].attention_fused == 2
    assert manifest.passes.strategies["concat"].after.matmul == 1 + 2 * 6 + 2  # the projection, layers, head
    batch = _batch(directory, "classify")
    served = load_artifact(tmp_path / "artifact").run(batch["input_ids"].numpy(), batch["attention_mask"].numpy(),
                                                      batch["token_type_ids"].numpy()).output
    with torch.no_grad():
        expected = AutoModelForSequenceClassification.from_pretrained(directory).eval()(**batch).logits.numpy()
    np.testing.assert_allclose(served, expected, atol=1e-4)


@pytest.mark.parametrize("family", ["mpnet", "electra"])
def test_sparse_wrappers_compute_splade_of_the_masked_lm(tmp_path, family):
    """`--task sparse`: the family's masked-LM head (MPNet's lm_head; ELECTRA's generator head, from its
    embedding size) under SPLADE's max pooling, padded and packed, equals transformers' logits pooled so."""
    from transformers import AutoModelForMaskedLM

    from artifact.packed_batch import pack_batch
    from compile.packed_model import PackedBertWrapper

    torch.manual_seed(3)
    tokenizer = _tokenizer(family)
    directory = tmp_path / family
    AutoModelForMaskedLM.from_config(_config(family, len(tokenizer), architectures=[
        {"mpnet": "MPNetForMaskedLM", "electra": "ElectraForMaskedLM"}[family]])).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    info = inspect_checkpoint(directory, "embed", "splade")
    assert info.pooling == "splade" and info.output_dim == len(tokenizer)
    wrapper = load_wrapper(info, "embed")
    batch = _batch(directory, "embed")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    types = batch.get("token_type_ids", torch.zeros_like(ids))
    with torch.no_grad():
        got = wrapper(ids, mask, types, torch.arange(ids.shape[1]).expand_as(ids))
        logits = AutoModelForMaskedLM.from_pretrained(directory, attn_implementation="eager").eval()(**batch).logits
        packed = PackedBertWrapper(wrapper)(*(torch.from_numpy(x) for x in pack_batch(
            ids.numpy(), mask.numpy(), types.numpy(), seq=ids.shape[1], tokens=int(mask.sum()) + 3)))
    expected = torch.log1p(torch.relu(logits * mask[..., None])).amax(dim=1)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=1e-5)
    np.testing.assert_allclose(packed.numpy(), got.numpy(), atol=1e-5)
