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


def tiny_bpe_tokenizer(sentences: list[str]):
    """A RoBERTa (byte-level BPE) tokenizer trained on `sentences`, with RoBERTa's special tokens at ids 0..4."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import RobertaTokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(sentences, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    merges = [tuple(pair) for pair in json.loads(bpe.to_str())["model"]["merges"]]
    return RobertaTokenizer(vocab=bpe.get_vocab(), merges=merges)


def scale_layer_norms(model, seed: int) -> None:
    """Every layer norm's scale and shift drawn at random (scales in [0.5, 1.5]), not left at 1 and 0."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=generator))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))


def save_tiny_nli(directory: Path, family: str, labels: list[str], sentences: list[str]) -> Path:
    """A 2-layer random-weight NLI classifier of `family` ("bert": MiniLM's tokenizer.json; "roberta": a BPE
    tokenizer trained on `sentences`, shipped as vocab.json and merges.txt only, without tokenizer.json,
    as slow-tokenizer checkpoints are) with `labels` as its id2label; weights drawn wide enough that its
    labels' scores differ."""
    import torch
    from transformers import AutoModelForSequenceClassification, RobertaConfig

    from loadtest.random_checkpoint import copy_tokenizer

    torch.manual_seed(11)
    names = {"id2label": dict(enumerate(labels)), "label2id": {label: i for i, label in enumerate(labels)},
             "num_labels": len(labels), "initializer_range": 0.3}
    if family == "bert":
        config = tiny_config(**names, architectures=["BertForSequenceClassification"])
    else:
        tokenizer = tiny_bpe_tokenizer(sentences)
        config = RobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=66, type_vocab_size=1, pad_token_id=1,
                               bos_token_id=0, eos_token_id=2, architectures=["RobertaForSequenceClassification"],
                               **names)
    model = AutoModelForSequenceClassification.from_config(config)
    scale_layer_norms(model, seed=12)
    model.save_pretrained(directory)
    if family == "bert":
        copy_tokenizer(directory)
    else:
        tokenizer.save_pretrained(directory)
        tokenizer.backend_tokenizer.model.save(str(directory))  # vocab.json and merges.txt
        (directory / "tokenizer.json").unlink()
    return directory


SENSITIVE_LINEAR = "bert.encoder.layer.1.output.dense"  # the linear that reads a planted checkpoint's defect


def save_planted_checkpoint(directory: Path, defect: str) -> Path:
    """A tiny sentence embedder (widths both int8 kernels' panels fit) whose layer-1 FFN output
    projection (SENSITIVE_LINEAR) reads a planted defect:
    `outlier`: channels 0-7 a thousand times the rest (the product unchanged), which smoothing removes;
    `cancelling`: channels 0 and 1 equal and huge, their weight columns opposite, so that they
    cancel and the answer lies in the small channels that per-token int8 rounds away: no per-channel
    scaling rescues it."""
    import torch
    from transformers import BertModel

    save_tiny_sentence_transformer(directory, seed=7, config={"hidden_size": 96, "intermediate_size": 192,
                                                              "num_attention_heads": 6})
    model = BertModel.from_pretrained(directory)
    layer = model.encoder.layer[1]
    up, down = layer.intermediate.dense, layer.output.dense
    with torch.no_grad():
        if defect == "outlier":
            up.weight[:8] *= 1000.0
            up.bias[:8] = 1000.0
            down.weight[:, :8] /= 1000.0
        else:
            up.weight[1] = up.weight[0] = up.weight[0] * 1000.0
            up.bias[1] = up.bias[0] = 1000.0
            down.weight[:, 0] = down.weight[:, 0] * 1000.0
            down.weight[:, 1] = -down.weight[:, 0]
    model.save_pretrained(directory)
    return directory
