"""`python -m loadtest.hybrid_bench`: bge-m3's hybrid request (dense + sparse + ColBERT) against
FlagEmbedding's `BGEM3FlagModel.encode(return_dense=True, return_sparse=True, return_colbert_vecs=True)`
on PyTorch, on the same texts and CPU.

A random-weight XLM-R of the given geometry (default bge-m3's: 24 layers of 1024, 16 heads, FFN
4096) with FlagEmbedding's two head files is written, compiled (packed), and both sides are timed
interleaved in one process: ours is what the server's /embed_hybrid runs per batch (tokenize, one
library call with the token output, the three outputs split as service/m3.py splits them), theirs
`encode` with its own tokenization. Workloads: one text of --tokens tokens, and a batch of --mixed texts
of lengths spread from 16 to --tokens. Prints a JSON line per workload (medians in ms and the ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from .arguments import at_least_one


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m loadtest.hybrid_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=at_least_one, default=24)
    parser.add_argument("--hidden", type=at_least_one, default=1024)
    parser.add_argument("--heads", type=at_least_one, default=16)
    parser.add_argument("--intermediate", type=at_least_one, default=4096)
    parser.add_argument("--tokens", type=at_least_one, default=128, help="the single text's length, the mix's longest")
    parser.add_argument("--mixed", type=at_least_one, default=8, help="texts in the mixed batch")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "int8", "auto"])
    parser.add_argument("--repeats", type=at_least_one, default=10)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--workdir", type=Path, help="where the checkpoint and artifact go (default: a temporary one)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    if args.workdir is not None:
        return _run(args, args.workdir)
    with tempfile.TemporaryDirectory() as scratch:
        return _run(args, Path(scratch))


def write_checkpoint(directory: Path, args) -> Path:
    """The random bge-m3 of `args`' geometry, its tokenizer trained on the shipped sentences."""
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    from compile.sentences import ACCURACY_SENTENCES

    from .random_checkpoint import family_tokenizer

    torch.manual_seed(0)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = family_tokenizer("xlm-roberta", list(ACCURACY_SENTENCES))
    config = XLMRobertaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, num_hidden_layers=args.layers,
                              num_attention_heads=args.heads, intermediate_size=args.intermediate,
                              max_position_embeddings=514, type_vocab_size=1, pad_token_id=1, bos_token_id=0,
                              eos_token_id=2)
    XLMRobertaModel(config, add_pooling_layer=False).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    torch.save(torch.nn.Linear(args.hidden, args.hidden).state_dict(), directory / "colbert_linear.pt")
    torch.save(torch.nn.Linear(args.hidden, 1).state_dict(), directory / "sparse_linear.pt")
    return directory


def texts_of(tokenizer, lengths: list[int]) -> list[str]:
    """Texts of the shipped sentences' words whose token counts reach each of `lengths`."""
    from compile.sentences import ACCURACY_SENTENCES

    words = " ".join(ACCURACY_SENTENCES).split()
    texts = []
    for length in lengths:
        count = 1
        while len(tokenizer.encode(" ".join(words[:count] * (1 + count // len(words))))) < length:
            count += 1
        texts.append(" ".join(words[:count] * (1 + count // len(words))))
    return texts


def _run(args, workdir: Path) -> int:
    import numpy as np
    from FlagEmbedding import BGEM3FlagModel
    from tokenizers import Tokenizer

    from artifact.loader import load_artifact
    from compile.config import CompileConfig
    from compile.pipeline import compile_model
    from compile.timing import interleaved_medians
    from service.m3 import M3Outputs
    from service.tokenization import TextTokenizer

    checkpoint = write_checkpoint(workdir / "bge-m3", args)
    artifact = workdir / "artifact"
    if not (artifact / "manifest.json").is_file():
        compile_model(CompileConfig(model=checkpoint, out=artifact, layout="packed", precision=args.precision,
                                    buckets=[f"packed-{max(args.tokens, 16)}"]))
    model = load_artifact(artifact)
    tokenizer = TextTokenizer(model.tokenizer_dir / "tokenizer.json", model.max_seq, model.manifest.model.vocab_size)
    heads = M3Outputs(model.tokenizer_dir)
    flag = BGEM3FlagModel(str(checkpoint), use_fp16=False, devices="cpu")
    raw = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    spread = np.linspace(16, args.tokens, args.mixed).astype(int).tolist()
    workloads = {f"1x{args.tokens}": texts_of(raw, [args.tokens]), f"mixed-{args.mixed}": texts_of(raw, spread)}

    def ours(texts):
        encoded = tokenizer.encode(texts, "right")
        width = max(map(len, encoded))
        ids, mask = np.zeros((len(texts), width), np.int64), np.zeros((len(texts), width), np.int64)
        for row, item in enumerate(encoded):
            ids[row, :len(item)], mask[row, :len(item)] = item.ids, 1
        result = model.run(ids, mask, tokens=True)
        dense = result.output / np.linalg.norm(result.output, axis=1, keepdims=True)
        return dense, [(heads.lexical_weights(item, rows), heads.colbert_vectors(item, rows))
                       for item, rows in zip(encoded, result.tokens)]

    for name, texts in workloads.items():
        medians = interleaved_medians({
            "ours": lambda texts=texts: ours(texts),
            "flag_embedding": lambda texts=texts: flag.encode(texts, batch_size=len(texts), return_dense=True,
                                                              return_sparse=True, return_colbert_vecs=True),
        }, args.repeats)
        ours_ms, theirs_ms = medians["ours"]["median_s"] * 1e3, medians["flag_embedding"]["median_s"] * 1e3
        print(json.dumps({"workload": name, "tokens": [len(raw.encode(text)) for text in texts],
                          "ours_ms": round(ours_ms, 2), "flag_embedding_ms": round(theirs_ms, 2),
                          "ratio": round(ours_ms / theirs_ms, 3), "precision": model.manifest.linear_precision,
                          "threads": args.threads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
