"""`python -m loadtest.sparse_bench`: dense vs block-sparse compiled builds, like TVM PR #5377's table.

Compiles the model once dense and once per (sparsity, block), each with one bucket at --shape,
then times all bucket libraries interleaved in one process. Each cell is the median latency of
the sparse build as a ratio of the dense build's, with the cosine similarity of the pruned
model's embeddings to the dense model's. A bad --model, --shape, --sparsities or --blocks exits 2
with one line. (A checkpoint that is sparse for real is timed as any other: `loadtest.pruned_checkpoint`
writes one, `loadtest.bench --compare` times its sparse build against its dense one.)
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
    parser = argparse.ArgumentParser(prog="python -m loadtest.sparse_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint (default: bundled MiniLM)")
    parser.add_argument("--shape", default="8x128")
    parser.add_argument("--sparsities", default="0.7,0.8,0.9,0.95")
    parser.add_argument("--blocks", default="8x1,16x1,32x1")
    parser.add_argument("--repeats", type=at_least_one, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/sparsity"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    from compile.errors import CompileError

    try:
        return _run(args, argv)
    except CompileError as exc:  # a bad checkpoint, shape, sparsity or block: the user's to fix
        print(f"python -m loadtest.sparse_bench: error: {exc}", file=sys.stderr)
        return 2


def _run(args, argv) -> int:
    from artifact.loader import load_artifact
    from compile.bucketing import parse_bucket
    from compile.checkpoint import example_inputs, inspect_checkpoint
    from compile.config import default_model_dir, load_config
    from compile.pipeline import compile_model
    from compile.timing import interleaved_medians

    shape = parse_bucket(args.shape)
    inspect_checkpoint(args.model or default_model_dir(), "embed")
    sparsities, blocks = args.sparsities.split(","), args.blocks.split(",")
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    models, sparsity = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        # Every configuration is validated before the first (minutes-long) compile.
        # Correctness of sparse builds is the test suite's job; here only speed and drift.
        configs = {name: load_config(None, {"model": args.model, "out": Path(scratch) / name.replace("@", "_"),
                                            "buckets": [shape.name], "max_batch": max(shape.batch, 8),
                                            "sparsity": fraction, "block": block, "validate": False,
                                            "sparse_choice": "density"})
                   for name, fraction, block in [("dense", None, None)] + [
                       (f"{s}@{b}", s, b) for s in sparsities for b in blocks]}
        for index, (name, config) in enumerate(configs.items(), 1):
            log(f"sparse_bench [{index}/{len(configs)}] compile {name} ...")
            manifest, _ = compile_model(config)
            models[name] = load_artifact(config.out)
            sparsity[name] = manifest.sparsity.model_dump() if manifest.sparsity else None
        ids, mask, _, _ = (x.numpy() for x in example_inputs(shape.batch, shape.seq, 30522, seed=0))
        log(f"sparse_bench: timing {len(models)} builds at {shape.name}, {args.repeats} interleaved rounds ...")
        stats = interleaved_medians({name: (lambda m=m: m.run(ids, mask)) for name, m in models.items()}, args.repeats,
                                    warm_calls=1)
    dense_s = stats["dense"]["median_s"]
    rows = [{"config": name, "median_ms": s["median_s"] * 1e3, "ratio_vs_dense": s["median_s"] / dense_s,
             "sparsity": sparsity[name]} for name, s in stats.items()]
    report = {"command": "python -m loadtest.sparse_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
              "shape": shape.name, "threads": args.threads, "repeats": args.repeats, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sparse_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown_table(report, sparsities, blocks)
    (args.out / "sparse_bench.md").write_text(table + "\n")
    print(table)
    return 0


def markdown_table(report: dict, sparsities: list[str], blocks: list[str]) -> str:
    by_name = {row["config"]: row for row in report["rows"]}
    dense = by_name["dense"]["median_ms"]
    lines = [f"Dense compiled build at {report['shape']}: {dense:.1f} ms (median of {report['repeats']}). "
             "Cells: sparse / dense median latency (mean cosine similarity to the dense model's outputs).", "",
             "| sparsity | " + " | ".join(f"block {b}" for b in blocks) + " |", "|---|" + "---|" * len(blocks)]
    for s in sparsities:
        cells = []
        for b in blocks:
            row = by_name[f"{s}@{b}"]
            cells.append(f"{row['ratio_vs_dense']:.2f}x ({row['sparsity']['cosine_vs_dense']:.3f})")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
