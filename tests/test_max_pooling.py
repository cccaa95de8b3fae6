"""Max pooling compiles to a max reduction the server can run: `bert-serve` loads TVM's runtime
library only, which has no top-k (what `max(dim).values` imports as). A max-pooled artifact,
padded and packed, served over real HTTP equals the masked max of transformers' hidden states."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.support.artifacts import compile_artifact


TEXTS = ["hello", "the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def client(serve, tiny_bert_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("max-artifacts")
    compile_artifact(tiny_bert_dir, root / "max-padded", ["2x16"], pooling="max", generic_shapes=["3x20"])
    compile_artifact(tiny_bert_dir, root / "max-packed", ["packed-16"], pooling="max", layout="packed",
                     generic_shapes=["3x20"])
    with serve([root / "max-padded", root / "max-packed"]) as running, \
            httpx.Client(base_url=running.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("model", ["max-padded", "max-packed"])
def test_max_pooled_embeddings_are_served(client, tiny_bert_dir, model):
    import torch
    from transformers import AutoTokenizer, BertModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)
    bert = BertModel.from_pretrained(tiny_bert_dir, add_pooling_layer=False).eval()
    with torch.no_grad():
        expected = [bert(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].amax(dim=0).numpy()
                    for text in TEXTS]
    response = client.post("/embed", json={"inputs": TEXTS, "normalize": False, "model": model})
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(response.json(), expected, atol=1e-4)
