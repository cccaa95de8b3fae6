"""Tiny random-weight BERT checkpoints, saved as transformers and sentence-transformers save them."""

from __future__ import annotations

from pathlib import Path

from loadtest.random_checkpoint import MAX_SEQ, family_config, family_tokenizer  # noqa: F401 - the tests' too

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
    scaling rescues it;
    `unseen`: channels 0-7 silent on every token of the shipped sentences, a thousand times the rest
    on the tokens they do not hold (`plant_unseen_outlier`)."""
    import torch
    from transformers import BertModel

    save_tiny_sentence_transformer(directory, seed=7, config={"hidden_size": 96, "intermediate_size": 192,
                                                              "num_attention_heads": 6})
    model = BertModel.from_pretrained(directory)
    layer = model.encoder.layer[1]
    up, down = layer.intermediate.dense, layer.output.dense
    with torch.no_grad():
        if defect == "unseen":
            plant_unseen_outlier(model, directory / "tokenizer.json")
        elif defect == "outlier":
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


def plant_unseen_outlier(model, tokenizer_file: Path) -> None:
    """Hidden channel 0 of the word embeddings raised on every token the shipped sentences do not hold,
    and SENSITIVE_LINEAR's input channels 0-7 made to read it past a threshold between the two kinds
    of token: on the sentences' tokens they are 0, on the others a thousand times the rest (the down
    projection's columns divided to match), a range the sentences never show."""
    import torch

    from compile.checkpoint import example_inputs
    from compile.passes.quantize import sentence_rows

    ids, mask = (torch.from_numpy(x) for x in sentence_rows(tokenizer_file, model.config.max_position_embeddings)[:2])
    embedding = model.embeddings.word_embeddings.weight
    unseen = torch.ones(embedding.shape[0], dtype=torch.bool)
    unseen[ids.unique()] = False
    layer = model.encoder.layer[1]
    up, down = layer.intermediate.dense, layer.output.dense
    with torch.no_grad():
        embedding[unseen, 0] += 20 * embedding.std()
        channel = {}
        hook = up.register_forward_hook(lambda module, inputs, output: channel.update(x=inputs[0][..., 0]))
        model(input_ids=ids, attention_mask=mask)
        seen_top = float(channel["x"][mask.bool()].max())
        random_ids, random_mask = example_inputs(8, 32, embedding.shape[0], seed=3)[:2]
        model(input_ids=random_ids, attention_mask=random_mask)
        hook.remove()
        unseen_low = float(channel["x"][(random_mask.bool()) & unseen[random_ids]].quantile(0.1))
        assert unseen_low > seen_top + 1.0, (seen_top, unseen_low)  # the threshold separates them
        gain = 1000.0 / (unseen_low - seen_top)
        up.weight[:8] = 0.0
        up.weight[:8, 0] = gain
        up.bias[:8] = -gain * (seen_top + 0.5)
        down.weight[:, :8] /= 1000.0


COLBERT_SETTINGS = {"query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": 12, "document_length": 24,
                    "do_query_expansion": True, "attend_to_expansion_tokens": False}


def save_tiny_colbert(directory: Path, projection: int = 16) -> Path:
    """A 2-layer BERT in PyLate's layout: its prefixes added to the tokenizer (the embeddings grown to
    them), a Dense projection without bias (1_Dense) and PyLate's settings in
    config_sentence_transformers.json (short query and document lengths, the default skip-list)."""
    import json
    import string

    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, BertModel

    from loadtest.random_checkpoint import copy_tokenizer

    torch.manual_seed(5)
    directory.mkdir(parents=True, exist_ok=True)
    model = BertModel(tiny_config(num_attention_heads=2), add_pooling_layer=False)  # heads of 16: fused attention
    copy_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens([COLBERT_SETTINGS["query_prefix"], COLBERT_SETTINGS["document_prefix"]])
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}]))
    (directory / "1_Dense").mkdir(exist_ok=True)
    (directory / "1_Dense" / "config.json").write_text(json.dumps({
        "in_features": TINY_SIZES["hidden_size"], "out_features": projection, "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity", "use_residual": False}))
    save_file({"linear.weight": torch.randn(projection, TINY_SIZES["hidden_size"])},
              str(directory / "1_Dense" / "model.safetensors"))
    (directory / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": "", "document": ""}, "default_prompt_name": None, "similarity_fn_name": "MaxSim",
        **COLBERT_SETTINGS, "skiplist_words": list(string.punctuation)}))
    return directory


def save_tiny_bge_m3(directory: Path, sentences: list[str]) -> Path:
    """A 2-layer XLM-R (a real unigram tokenizer trained on `sentences`) with bge-m3's two heads as
    FlagEmbedding saves them: colbert_linear.pt (hidden -> hidden) and sparse_linear.pt (hidden -> 1)."""
    import torch
    from transformers import AutoModel

    torch.manual_seed(11)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = family_tokenizer("xlm-roberta", sentences)
    config = family_config("xlm-roberta", len(tokenizer))
    model = AutoModel.from_config(config)
    with torch.no_grad():  # layer norms not all 1, so that a missed one shows
        for name, parameter in model.named_parameters():
            if "LayerNorm.weight" in name:
                parameter.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    torch.save(torch.nn.Linear(config.hidden_size, config.hidden_size).state_dict(), directory / "colbert_linear.pt")
    sparse = torch.nn.Linear(config.hidden_size, 1)
    with torch.no_grad():
        sparse.bias.fill_(0.05)  # most tokens weigh something, some relu to 0
    torch.save(sparse.state_dict(), directory / "sparse_linear.pt")
    return directory
