"""`python -m loadtest.random_checkpoint --out DIR`: a BERT (or ModernBERT) of any geometry with random
weights, saved as a sentence-transformers checkpoint (mean pooling) with the bundled MiniLM's tokenizer.

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
    (directory / "sentence_bert_config.json").write_text(  # MiniLM's says 256: this model takes what it has
        json.dumps({"max_seq_length": bert_config.max_position_embeddings, "do_lower_case": False}))
    (directory / "modules.json").write_text(
        json.dumps([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    )
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": bert_config.hidden_size, "pooling_mode_mean_tokens": True}))
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
    (directory / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": modern.max_position_embeddings, "do_lower_case": False}))
    if classifier is None:
        (directory / "modules.json").write_text(json.dumps(
            [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
             {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (directory / "1_Pooling").mkdir(exist_ok=True)
        (directory / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": modern.hidden_size, "pooling_mode_mean_tokens": True}))
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.random_checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=("bert", "modernbert"), default="bert",
                        help="modernbert: --max-positions positions (default 8192), a global layer every third")
    parser.add_argument("--max-positions", type=int, default=None)
    args = parser.parse_args(argv)
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
