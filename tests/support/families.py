"""Checks the family tests share: a checkpoint's PyTorch wrappers against transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def transformers_output(directory: Path, task: str, batch) -> torch.Tensor:
    """What transformers computes for a tokenized `batch` (eager attention): the classifier's logits, or the
    mean of the last hidden state over the real tokens (sentence-transformers' mean pooling)."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    with torch.no_grad():
        if task == "classify":
            return AutoModelForSequenceClassification.from_pretrained(
                directory, attn_implementation="eager").eval()(**batch).logits
        hidden = AutoModel.from_pretrained(directory, attn_implementation="eager").eval()(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None]
        return (hidden * mask).sum(1) / mask.sum(1)


def assert_wrappers_compute_what_transformers_does(wrapper, directory: Path, task: str, batch) -> None:
    """The padded `wrapper` (compile.checkpoint.load_wrapper; positions from 0, token types zero where the
    tokenizer gives none) equals transformers fed as transformers feeds it; the packed wrapper built on it
    equals the padded one (with three pad rows past the real tokens, as a packed library computes them)."""
    from artifact.packed_batch import pack_batch
    from compile.packed_model import PackedBertWrapper

    ids, mask = batch["input_ids"], batch["attention_mask"]
    types = batch.get("token_type_ids", torch.zeros_like(ids))
    with torch.no_grad():
        got = wrapper(ids, mask, types, torch.arange(ids.shape[1]).expand_as(ids))
        packed = PackedBertWrapper(wrapper)(*(torch.from_numpy(x) for x in pack_batch(
            ids.numpy(), mask.numpy(), types.numpy(), seq=ids.shape[1], tokens=int(mask.sum()) + 3)))
    np.testing.assert_allclose(got.numpy(), transformers_output(directory, task, batch).numpy(), atol=1e-5)
    np.testing.assert_allclose(packed.numpy(), got.numpy(), atol=1e-5)
