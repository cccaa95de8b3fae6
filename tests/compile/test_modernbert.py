"""ModernBERT through the pipeline: tiny random-weight checkpoints (3 layers: a global one, then two with
sliding windows of 16 keys, half-window 8, so that short inputs already reach past the window; layer norms
not all 1), the wrappers against transformers in both layouts, and compiled artifacts against transformers
with a long input (longer than the window, and 1,100 tokens) in a packed batch beside short ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from artifact.loader import load_artifact
from artifact.packed_batch import pack_batch
from compile.checkpoint import inspect_checkpoint, load_wrapper
from compile.packed_model import PackedBertWrapper
from loadtest.random_checkpoint import save_modernbert
from tests.support.artifacts import compile_artifact
from tests.support.checkpoints import TINY_LABELS

pytestmark = pytest.mark.slow  # collected first: see conftest.py

CONFIG = {"vocab_size": 30522, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
          "intermediate_size": 96, "max_position_embeddings": 1200, "local_attention": 16}
CLASSIFIER = {"num_labels": 3, "id2label": TINY_LABELS, "label2id": {v: k for k, v in TINY_LABELS.items()},
              "architectures": ["ModernBertForSequenceClassification"]}
LENGTHS = [1100, 40, 9, 1]  # many windows long, a few, within one, a single token


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, object]:
    """'embed' (mean pooling), 'classify' (token 0's head), 'classify-mean' (the tokens' mean's head)."""
    root = tmp_path_factory.mktemp("modernbert")
    return {"embed": save_modernbert(root / "embed", 0, CONFIG),
            "classify": save_modernbert(root / "classify", 1, CONFIG, CLASSIFIER),
            "classify-mean": save_modernbert(root / "classify-mean", 2, CONFIG,
                                             {**CLASSIFIER, "classifier_pooling": "mean"})}


def _batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (from the tokenizer's ordinary words) and the mask of right-padded rows of `lengths`."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30000, (len(lengths), max(lengths)), generator=generator)
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def _transformers(directory, task: str, ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    """What transformers (eager attention) answers: the real tokens' mean, or the classifier's logits."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    with torch.no_grad():
        if task == "classify":
            return AutoModelForSequenceClassification.from_pretrained(directory, attn_implementation="eager").eval()(
                input_ids=ids, attention_mask=mask).logits.numpy()
        hidden = AutoModel.from_pretrained(directory, attn_implementation="eager").eval()(
            input_ids=ids, attention_mask=mask).last_hidden_state
        return ((hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)).numpy()


@pytest.mark.parametrize("kind", ["embed", "classify", "classify-mean"])
def test_wrappers_compute_what_transformers_does(checkpoints, kind):
    """Padded and packed wrappers (rotary tables per layer type, windows, pre-norm, GeGLU, the head's
    pooling) equal transformers, with a sequence many windows long beside short ones."""
    task = kind.split("-")[0]
    info = inspect_checkpoint(checkpoints[kind], task)
    assert info.max_seq == 1200 and info.hidden_size == 64
    wrapper = load_wrapper(info, task)
    ids, mask = _batch([200, *LENGTHS[1:]])
    with torch.no_grad():
        padded = wrapper(ids, mask, torch.zeros_like(ids), torch.arange(ids.shape[1]).expand_as(ids)).numpy()
        packed = PackedBertWrapper(wrapper)(*(torch.from_numpy(x) for x in pack_batch(
            ids.numpy(), mask.numpy(), tokens=int(mask.sum()) + 3))).numpy()
    np.testing.assert_allclose(padded, _transformers(checkpoints[kind], task, ids, mask), atol=2e-5)
    np.testing.assert_allclose(packed, padded, atol=2e-5)


def test_sparse_wrapper_is_splade_of_the_masked_lm(tmp_path):
    """--task sparse: the masked-LM head (dense, activation, norm, decoder) under SPLADE's max pooling."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    from loadtest.random_checkpoint import MINILM_SPECIAL_IDS, copy_tokenizer

    torch.manual_seed(3)
    model = ModernBertForMaskedLM(ModernBertConfig(**{**MINILM_SPECIAL_IDS, **CONFIG,
                                                      "architectures": ["ModernBertForMaskedLM"]})).eval()
    model.save_pretrained(tmp_path)
    copy_tokenizer(tmp_path)
    info = inspect_checkpoint(tmp_path, "embed", "splade")
    ids, mask = _batch([30, 12])
    with torch.no_grad():
        got = load_wrapper(info, "embed")(ids, mask, torch.zeros_like(ids), torch.arange(30).expand_as(ids))
        logits = model(input_ids=ids, attention_mask=mask).logits
    expected = torch.log1p(torch.relu(logits * mask[..., None])).amax(1)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=2e-5)


@pytest.fixture(scope="module")
def packed_fp32(checkpoints, tmp_path_factory):
    """A packed fp32 embedder (one bucket; the generic library up to 1,200 tokens)."""
    out = tmp_path_factory.mktemp("modernbert-packed") / "artifact"
    manifest, _ = compile_artifact(checkpoints["embed"], out, ["packed-32"], layout="packed", precision="fp32")
    return manifest, load_artifact(out)


def test_packed_artifact_fuses_every_layer_and_matches_transformers(checkpoints, packed_fp32):
    """Every layer's attention (the global one and both windowed ones) on the fused kernel; a 1,100-token
    input in a packed batch beside short ones (the window never reaching across sequences) as transformers."""
    manifest, model = packed_fp32
    assert manifest.validated and manifest.model.model_type == "modernbert"
    assert manifest.generic.max_seq == 1200
    assert manifest.passes.strategies["concat"].attention_fused == 3
    ids, mask = _batch(LENGTHS, seed=1)
    served = model.run(ids.numpy(), mask.numpy()).output
    np.testing.assert_allclose(served, _transformers(checkpoints["embed"], "embed", ids, mask), atol=1e-4)
    short = [length for length in LENGTHS if length <= 32]  # on the packed-32 library
    ids, mask = _batch(short, seed=2)
    np.testing.assert_allclose(model.run(ids.numpy(), mask.numpy()).output,
                               _transformers(checkpoints["embed"], "embed", ids, mask), atol=1e-4)


@pytest.mark.requires("avx512_bf16")
def test_padded_bf16_classifier_matches_transformers(checkpoints, tmp_path):
    """bf16 linears (this CPU's default precision) in the padded layout, a classifier reading the tokens'
    mean: its probabilities within bf16's gate of transformers', past the window too."""
    directory = checkpoints["classify-mean"]
    manifest, _ = compile_artifact(directory, tmp_path / "artifact", ["2x48"], task="classify", precision="bf16")
    assert manifest.validated and manifest.labels == list(TINY_LABELS.values())
    assert manifest.passes.strategies["concat"].attention_fused == 3
    ids, mask = _batch([48, 20])
    served = load_artifact(tmp_path / "artifact").run(ids.numpy(), mask.numpy()).output
    expected = torch.softmax(torch.from_numpy(_transformers(directory, "classify", ids, mask)), -1).numpy()
    np.testing.assert_allclose(torch.softmax(torch.from_numpy(served), -1).numpy(), expected, atol=0.01)
