"""`python -m loadtest.pruned_checkpoint --source DIR --out DIR`: a copy of a checkpoint with its linears
block-pruned (the largest blocks by L2 norm kept), saved as a checkpoint whose zeros are its own.

This is the checkpoint a fine-pruned model arrives as: `bert-compile --sparsity from-checkpoint` compiles it
without changing it. Pruning without fine-tuning changes what the model computes, so use it to time the
sparse kernels, not to serve. Files other than the weights (tokenizer, sentence-transformers metadata,
pooling) are copied as they are.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def prune_checkpoint(source: Path, out: Path, sparsity: float, block: tuple[int, int],
                     layers: tuple[str, ...]) -> int:
    """Write `source` pruned to `out`; returns how many linears were pruned."""
    from transformers import AutoModel

    from compile.passes.sparsity import prune_model

    model = AutoModel.from_pretrained(source)
    pruned = prune_model(model, 1.0 - sparsity, block, layers)
    shutil.copytree(source, out, dirs_exist_ok=True,
                    ignore=lambda _, names: [n for n in names if n in WEIGHT_FILES])
    model.save_pretrained(out)
    return pruned


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.pruned_checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sparsity", type=float, default=0.9, help="fraction of blocks set to zero")
    parser.add_argument("--block", default="16x1", help="ROWSxCOLS of the [out, in] weight")
    parser.add_argument("--layers", default="ffn,attention_output", help="comma-separated: ffn, attention_output, qkv")
    args = parser.parse_args(argv)
    rows, cols = (int(v) for v in args.block.lower().split("x"))
    if not 0 <= args.sparsity < 1:
        parser.error("--sparsity is a fraction in [0, 1)")
    try:
        count = prune_checkpoint(args.source, args.out, args.sparsity, (rows, cols), tuple(args.layers.split(",")))
    except (OSError, ValueError) as exc:
        parser.exit(2, f"{str(exc).splitlines()[0]}\n")
    print(f"wrote {args.out}: {count} linears with {args.sparsity:g} of their {args.block} blocks zero")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
