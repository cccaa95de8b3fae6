"""Tiny random-weight BERT checkpoints, saved as transformers and sentence-transformers save them."""

from __future__ import annotations

from pathlib import Path

TINY_LABELS = {0: "negative", 1: "neutral", 2: "positive"}

TINY_SIZES = {"vocab_size": 30522,  # the MiniLM tokenizer's vocabulary, copied next to the weights
              "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
              "max_position_embeddings": 64}

WHOLE_PANELS = {"hidden_size": 96, "num_attention_heads": 3, "intermediate_size": 192}  # every int8 kernel's


def tiny_config(**extra):
    """A BertConfig of TINY_SIZES, with `extra` on top."""
    from transformers import BertConfig

    return BertConfig(**{**TINY_SIZES, **extra})


def save_tiny_sentence_transformer(directory: Path, seed: int, prompts: dict[str, str] | None = None,
                                   config: dict | None = None) -> Path:
    """A 2-layer BertModel with sentence-transformers mean pooling metadata (and prompts, if given)."""
    from loadtest.random_checkpoint import save_sentence_transformer

    return save_sentence_transformer(directory, seed, {**TINY_SIZES, **(config or {})}, prompts)


def save_tiny_classifier(directory: Path) -> Path:
    """A 2-layer BertForSequenceClassification with three named labels."""
    import torch
    from transformers import BertForSequenceClassification

    from loadtest.random_checkpoint import copy_tokenizer

    torch.manual_seed(1)
    config = tiny_config(num_labels=3, id2label=TINY_LABELS, label2id={v: k for k, v in TINY_LABELS.items()},
                         architectures=["BertForSequenceClassification"])
    BertForSequenceClassification(config).save_pretrained(directory)
    copy_tokenizer(directory)
    return directory
