"""`python -m loadtest.random_checkpoint --out DIR`: a BERT (or ModernBERT, or DeBERTa-v3) of any geometry
with random weights, saved as a sentence-transformers checkpoint (mean pooling) with the bundled MiniLM's
tokenizer (DeBERTa: a small SentencePiece model).

Timings do not depend on the weights, so this is how the benchmarks time geometries no bundled
model has (bert-base's 12 x 768) without downloading one. The tests build their tiny models with it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from compile.checkpoint import TOKENIZER_FILES
from compile.config import default_model_dir
from compile.tokenizer import TOKENIZER_JSON


def copy_tokenizer(destination: Path) -> None:
    """MiniLM's WordPiece tokenizer files (vocabulary 30522) into `destination`."""
    source = default_model_dir()
    for name in (TOKENIZER_JSON, *TOKENIZER_FILES):
        if (source / name).is_file():
            shutil.copy2(source / name, destination / name)


SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # RoBERTa's and XLM-R's ids 0..3 (unk must be 3 for XLM-R)
MAX_SEQ = 40  # longest input of the family checkpoints; RoBERTa's position table holds two more rows


def family_tokenizer(family: str, sentences: list[str]):
    """A real fast tokenizer of the family's kind, trained on `sentences`."""
    import json
    from string import ascii_lowercase

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import DistilBertTokenizer, RobertaTokenizer, XLMRobertaTokenizer

    if family == "distilbert":
        words = sorted({w.strip(".?").lower() for s in sentences for w in s.split()} | set(ascii_lowercase))
        vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "?", "-", *words,
                 *(f"##{c}" for c in ascii_lowercase)]  # WordPiece spells unseen words letter by letter
        return DistilBertTokenizer(vocab={token: i for i, token in enumerate(vocab)})
    if family == "roberta":
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.train_from_iterator(sentences, trainers.BpeTrainer(
            vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        merges = [tuple(pair) for pair in json.loads(bpe.to_str())["model"]["merges"]]
        return RobertaTokenizer(vocab=bpe.get_vocab(), merges=merges)
    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace()])
    unigram.train_from_iterator(sentences, trainers.UnigramTrainer(vocab_size=200, special_tokens=SPECIALS,
                                                                   unk_token="<unk>"))
    return XLMRobertaTokenizer(vocab=[tuple(piece) for piece in json.loads(unigram.to_str())["model"]["vocab"]])


def family_config(family: str, vocab_size: int, **extra):
    from transformers import DistilBertConfig, RobertaConfig, XLMRobertaConfig

    if family == "distilbert":
        return DistilBertConfig(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                max_position_embeddings=MAX_SEQ, pad_token_id=0, **extra)
    config_class = RobertaConfig if family == "roberta" else XLMRobertaConfig
    return config_class(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=MAX_SEQ + 2, type_vocab_size=1,
                        pad_token_id=1, bos_token_id=0, eos_token_id=2, **extra)


def write_sentence_transformers_files(directory: Path, max_seq: int, pooled_width: int | None) -> None:
    """sentence_bert_config.json with the model's own input limit `max_seq` (MiniLM's copied tokenizer
    says 256: a model takes what it has) and, for an embedder (`pooled_width`: its hidden size), its
    modules: the transformer, then mean pooling."""
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq, "do_lower_case": False}))
    if pooled_width is None:
        return
    (directory / "modules.json").write_text(json.dumps(
        [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
         {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": pooled_width, "pooling_mode_mean_tokens": True}))


def save_sentence_transformer(directory: Path, seed: int, config: dict, prompts: dict[str, str] | None = None) -> Path:
    """A random-weight BertModel of `config` (BertConfig keys) with sentence-transformers mean
    pooling metadata (and prompts, if given)."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    bert_config = BertConfig(**config)
    directory.mkdir(parents=True, exist_ok=True)
    BertModel(bert_config, add_pooling_layer=False).save_pretrained(directory)
    copy_tokenizer(directory)
    write_sentence_transformers_files(directory, bert_config.max_position_embeddings, bert_config.hidden_size)
    if prompts is not None:
        (directory / "config_sentence_transformers.json").write_text(
            json.dumps({"prompts": prompts, "default_prompt_name": None}))
    return directory


MINILM_SPECIAL_IDS = {"pad_token_id": 0, "cls_token_id": 101, "bos_token_id": 101, "sep_token_id": 102,
                      "eos_token_id": 102}  # in the copied tokenizer's vocabulary


def save_modernbert(directory: Path, seed: int, config: dict, classifier: dict | None = None) -> Path:
    """A random-weight ModernBERT of `config` (ModernBertConfig keys) with the copied tokenizer: a
    sentence-transformers embedder (mean pooling), or with `classifier` (config keys such as id2label) a
    ModernBertForSequenceClassification. Its layer norms' scales and biases are random too (not 1 and 0),
    so that a wrong norm shows in the answers."""
    import torch
    from transformers import ModernBertConfig, ModernBertForSequenceClassification, ModernBertModel

    torch.manual_seed(seed)
    modern = ModernBertConfig(**{**MINILM_SPECIAL_IDS, **config, **(classifier or {})})
    model = (ModernBertForSequenceClassification(modern) if classifier is not None else ModernBertModel(modern)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                if module.bias is not None:
                    module.bias.uniform_(-0.2, 0.2)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    copy_tokenizer(directory)
    write_sentence_transformers_files(directory, modern.max_position_embeddings,
                                      modern.hidden_size if classifier is None else None)
    return directory


DEBERTA_SPECIALS = {"pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]", "unk_token": "[UNK]",
                    "bos_token": "[CLS]", "eos_token": "[SEP]", "mask_token": "[MASK]"}
# deberta-v3-base's attention: keys shared with the positions', a normed relative table, no absolute positions
DEBERTA_V3 = dict(relative_attention=True, share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False,
                  type_vocab_size=0, pos_att_type=["p2c", "c2p"], pad_token_id=0)


def deberta_spm_model(sentences: list[str], vocab_size: int = 120) -> bytes:
    """A SentencePiece unigram model trained on `sentences`, DeBERTa-v3's special tokens at its ids
    ([PAD] 0, [CLS] 1, [SEP] 2)."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size, model_type="unigram",
        pad_id=0, bos_id=1, eos_id=2, unk_id=3, pad_piece="[PAD]", bos_piece="[CLS]", eos_piece="[SEP]",
        unk_piece="[UNK]", user_defined_symbols=["[MASK]"], hard_vocab_limit=False, minloglevel=2)
    return model.getvalue()


def save_deberta(directory: Path, seed: int, config: dict) -> Path:
    """A random-weight DeBERTa-v2 model of `config` (DebertaV2Config keys) with DEBERTA_V3's attention,
    as a sentence-transformers embedder (mean pooling), and a SentencePiece model trained on the
    shipped sentences as spm.model alone, as DeBERTa-v3 ships its tokenizer."""
    import torch
    from transformers import DebertaV2Config, DebertaV2Model

    from compile.sentences import ACCURACY_SENTENCES

    torch.manual_seed(seed)
    deberta = DebertaV2Config(**{**DEBERTA_V3, **config})
    directory.mkdir(parents=True, exist_ok=True)
    DebertaV2Model(deberta).save_pretrained(directory)
    (directory / "spm.model").write_bytes(deberta_spm_model(ACCURACY_SENTENCES * 4))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "DebertaV2Tokenizer", "do_lower_case": False,
         "model_max_length": deberta.max_position_embeddings, **DEBERTA_SPECIALS}))
    write_sentence_transformers_files(directory, deberta.max_position_embeddings, deberta.hidden_size)
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.random_checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=("bert", "modernbert", "deberta-v2"), default="bert",
                        help="modernbert: --max-positions positions (default 8192), a global layer every third; "
                             "deberta-v2: deberta-v3-base's attention and vocabulary (128,100), 256 position buckets")
    parser.add_argument("--max-positions", type=int, default=None)
    args = parser.parse_args(argv)
    if args.family == "deberta-v2":
        save_deberta(args.out, args.seed, {
            "hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
            "intermediate_size": args.intermediate, "max_position_embeddings": args.max_positions or 512,
            "vocab_size": 128100, "position_buckets": 256, "max_relative_positions": -1, "layer_norm_eps": 1e-7})
        print(f"wrote {args.out}")
        return 0
    if args.family == "modernbert":
        save_modernbert(args.out, args.seed, {
            "hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
            "intermediate_size": args.intermediate, "max_position_embeddings": args.max_positions or 8192})
        print(f"wrote {args.out}")
        return 0
    save_sentence_transformer(args.out, args.seed, {
        "vocab_size": 30522, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "intermediate_size": args.intermediate,
        "max_position_embeddings": args.max_positions or 512})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

