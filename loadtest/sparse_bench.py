"""`python -m loadtest.sparse_bench`: dense vs block-sparse compiled builds, like TVM PR #5377's table.

Compiles the model once dense and once per (sparsity, block), each with one bucket at --shape,
then times all bucket libraries interleaved in one process. Each cell is the median latency of
the sparse build as a ratio of the dense build's, with the cosine similarity of the pruned
model's embeddings to the dense model's. A bad --model, --shape, --sparsities or --blocks exits 2
with one line.
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
    parser.add_argument("--from-checkpoint", dest="from_checkpoint", type=float, metavar="DENSITY",
                        help="instead of the table: a copy of the checkpoint whose FFN and attention-output weights "
                             "keep this block density (the first --blocks), as if trained sparse, compiled dense and "
                             "with --sparsity from-checkpoint (both validated against PyTorch on it), timed")
    parser.add_argument("--out", type=Path, default=Path("docs/sparsity"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    from compile.errors import CompileError

    try:
        return _from_checkpoint(args, argv) if args.from_checkpoint is not None else _run(args, argv)
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


def _from_checkpoint(args, argv) -> int:
    """A checkpoint that is sparse for real: dense compile against `--sparsity from-checkpoint`."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from artifact.loader import load_artifact
    from compile.bucketing import parse_bucket
    from compile.checkpoint import example_inputs
    from compile.config import default_model_dir, load_config
    from compile.passes.sparsity import DEFAULT_LAYERS, LAYERS, prune_blocks
    from compile.pipeline import compile_model
    from compile.timing import interleaved_medians

    shape, block = parse_bucket(args.shape), args.blocks.split(",")[0]
    rows, cols = (int(v) for v in block.split("x"))
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    suffixes = tuple(f"{suffix}.weight" for kind in DEFAULT_LAYERS for suffix in LAYERS[kind])
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = Path(scratch) / "sparse-checkpoint"
        shutil.copytree(args.model or default_model_dir(), checkpoint)
        weights = load_file(str(checkpoint / "model.safetensors"))
        for name, weight in weights.items():
            if name.endswith(suffixes) and ".layer." in name:
                weights[name] = torch.from_numpy(prune_blocks(weight.numpy(), args.from_checkpoint, (rows, cols)))
        save_file(weights, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
        manifests, models = {}, {}
        for name, sparsity in (("dense", None), ("from-checkpoint", "from-checkpoint")):
            log(f"sparse_bench: compile {name} ...")
            config = load_config(None, {"model": checkpoint, "out": Path(scratch) / name, "buckets": [shape.name],
                                        "max_batch": max(shape.batch, 8), "sparsity": sparsity, "block": block})
            manifests[name], _ = compile_model(config)
            models[name] = load_artifact(config.out)
        ids, mask, _, _ = (x.numpy() for x in example_inputs(shape.batch, shape.seq, 30522, seed=0))
        log(f"sparse_bench: timing at {shape.name}, {args.repeats} interleaved rounds ...")
        stats = interleaved_medians({name: (lambda m=m: m.run(ids, mask)) for name, m in models.items()},
                                    args.repeats, warm_calls=1)
    dense_s = stats["dense"]["median_s"]
    report = {"command": "python -m loadtest.sparse_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
              "shape": shape.name, "block": block, "density": args.from_checkpoint, "threads": args.threads,
              "repeats": args.repeats,
              "builds": {name: {"median_ms": stats[name]["median_s"] * 1e3, "ratio_vs_dense": stats[name]["median_s"] / dense_s,
                                "max_abs_diff": manifests[name].buckets[0].max_abs_diff,
                                "sparsity": manifests[name].sparsity.model_dump() if manifests[name].sparsity else None}
                         for name in models}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "from_checkpoint.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"A copy of the checkpoint whose FFN and attention-output weights keep {args.from_checkpoint:g} of their "
             f"{block} blocks, at {shape.name} (medians of {args.repeats} interleaved rounds):", "",
             "| build | ms | / dense | max abs diff vs PyTorch on the checkpoint | linears on the BSR kernel |",
             "|---|---|---|---|---|"]
    for name, build in report["builds"].items():
        sparse = build["sparsity"]
        linears = f"{sparse['rewritten']} of {len(sparse['choices'])} timed" if sparse else "-"
        lines.append(f"| {name} | {build['median_ms']:.1f} | {build['ratio_vs_dense']:.2f}x | {build['max_abs_diff']:.1e} "
                     f"| {linears} |")
    table = "\n".join(lines)
    (args.out / "from_checkpoint.md").write_text(table + "\n")
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
