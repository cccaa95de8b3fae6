"""`python -m loadtest.bench`: compiled bucket vs generic library vs PyTorch eager vs ONNX Runtime.

One process, one thread count for every backend, interleaved repeated runs, medians and
ratios per shape, GFLOP/s against this machine's measured fp32 matmul peak. Before timing a
shape, every candidate's output is compared with PyTorch eager's; the largest absolute
difference per candidate goes into the JSON (`agreement`), and a candidate beyond the dtype's
tolerance stops the benchmark (exit 1): a fast wrong answer is not a result. Writes JSON, a
PNG bar chart and a markdown table. Exit 2 when an artifact directory cannot be loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

DEFAULT_SHAPES = "1x16,8x128,32x128,1x512"
DEFAULT_GENERIC_SHAPES = "5x100"
PROG = "python -m loadtest.bench"
# libgomp spins under torch between a call's parallel regions: 10000 bridges them, and its
# worker sleeps ~2 ms after the call (fewer spins left part of the gaps unbridged).
TORCH_SPIN_COUNT = 10000
# Max |candidate - PyTorch eager| per dtype: looser than the compile stage's validation bounds
# (1e-4, 2e-2) since ONNX Runtime and torch.compile reorder reductions too, and far below what a
# wrong model or wrong weights give (differences of the order of the outputs themselves).
TOLERANCE = {"float32": 1e-3, "float16": 5e-2}
# An int8 candidate agrees when every output row is this close in direction to PyTorch fp32: far
# from what wrong weights give, loose enough for ONNX Runtime's dynamic int8 on random token ids
# (0.97 at 32x128 here); each candidate's least cosine is reported.
INT8_LEAST_COSINE = 0.95


def parse_args(argv):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, required=True, help="compiled artifact directory")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="BxS shapes, ideally buckets of the artifact")
    parser.add_argument("--generic-shapes", default=DEFAULT_GENERIC_SHAPES,
                        help="non-bucket shapes: generic library vs the bucket that would serve them padded")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warm-calls", type=int, default=1,
                        help="untimed calls of a candidate before each timed one, so that it runs with its own "
                             "weights in the caches, as a server between requests (0: right after another runtime)")
    parser.add_argument("--no-onnx", action="store_true", help="skip ONNX Runtime (always skipped on CUDA)")
    parser.add_argument("--onnx-int8", action="store_true",
                        help="also ONNX Runtime int8 (quantize_dynamic, QInt8 per channel) on the plain export and on "
                             "the transformers-optimized graph")
    parser.add_argument("--torch-compile", action="store_true", help="also time torch.compile(wrapper)")
    parser.add_argument("--compare", type=Path, action="append", default=[], metavar="ARTIFACTS",
                        help="another artifact of the same model (e.g. built without CUDA graphs) whose "
                             "libraries join the interleaved runs; repeatable")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/cpu"), help="directory for JSON + PNG")
    return parser.parse_args(argv)


def bert_flops(config: dict, lengths: list[int]) -> float:
    """Multiply-adds x 2 of the encoder's matmuls (linear layers + attention) over each sequence's
    real tokens: the work every candidate must do, whatever padding it computes besides."""
    def value(*keys):  # BERT, RoBERTa and XLM-R's key, then DistilBERT's
        return next(config[key] for key in keys if key in config)

    hidden, inter = value("hidden_size", "dim"), value("intermediate_size", "hidden_dim")
    layers = value("num_hidden_layers", "n_layers")
    linear = 2 * sum(lengths) * (4 * hidden * hidden + 2 * hidden * inter)
    attention = 2 * 2 * sum(length * length for length in lengths) * hidden
    return float(layers * (linear + attention))


def matmul_peak_gflops(threads: int, device: str = "cpu", dtype: str = "float32") -> float:
    """PyTorch's GEMM rate at 1024^3 (MKL/oneDNN on CPU, cuBLAS on GPU): the practical peak."""
    import torch

    from compile.timing import interleaved_medians

    torch.set_num_threads(threads)
    size = 1024 if device == "cpu" else 8192
    a, b = (torch.randn(size, size, device=device, dtype=getattr(torch, dtype)) for _ in range(2))

    def gemm():
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()

    stats = interleaved_medians({"gemm": gemm}, repeats=20, warmup=3)
    return 2 * size**3 / stats["gemm"]["median_s"] / 1e9


def as_array(output) -> np.ndarray:
    """A candidate's output as a float32 host array: a loader RunResult, ONNX Runtime's list of
    outputs (the first is the model's), a torch tensor, or an array."""
    if hasattr(output, "output"):
        output = output.output
    elif isinstance(output, list):
        output = output[0]
    if hasattr(output, "detach"):
        output = output.detach().float().cpu().numpy()
    return np.asarray(output, dtype=np.float32)


def agreement(outputs: dict[str, np.ndarray], reference: np.ndarray) -> dict[str, float]:
    """Max |output - reference| per candidate (inf for a wrong shape, nan for a non-finite output)."""
    diffs = {}
    for label, output in outputs.items():
        if output.shape != reference.shape:
            diffs[label] = float("inf")
        else:
            diffs[label] = float(np.abs(output - reference).max()) if output.size else 0.0
    return diffs


def least_cosine(output: np.ndarray, reference: np.ndarray) -> float:
    """The smallest cosine similarity of an output row to the reference's (how int8 is held)."""
    if output.shape != reference.shape:
        return float("-inf")
    norms = np.linalg.norm(output, axis=1) * np.linalg.norm(reference, axis=1)
    return float(np.min(np.sum(output * reference, axis=1) / np.maximum(norms, 1e-30)))


def best_peers(stats: dict) -> dict[str, str]:
    """The fastest candidate of each peer: PyTorch (eager or SDPA attention, torch.compile), ONNX
    Runtime fp32 and ONNX Runtime int8 (plain or optimized graph). Ratios are taken against these."""
    groups = {"torch": [k for k in stats if k.startswith("torch_")],
              "onnxruntime": [k for k in stats if k.startswith("onnxruntime") and "int8" not in k],
              "onnxruntime_int8": [k for k in stats if k.startswith("onnxruntime_int8")]}
    return {group: min(labels, key=lambda k: stats[k]["median_s"]) for group, labels in groups.items() if labels}


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from artifact.cores import limit_pool_spinning
    from artifact.errors import ArtifactError
    from compile.bucketing import parse_buckets
    from compile.errors import CompileError

    from .machine import describe as describe_machine
    from .strategy_table import read_manifest

    try:
        shapes = [(s, "bucket") for s in parse_buckets(args.shapes)] + [
            (s, "generic") for s in parse_buckets(args.generic_shapes)]
        for directory in (args.artifacts, *args.compare):
            read_manifest(directory)
    except (ArtifactError, CompileError) as exc:
        return _fail(str(exc), 2)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # before TVM's thread pool starts
    # Every runtime's idle workers spin between the parallel sections of a call (without it, a
    # call waits for sleeping workers to wake at each one; docs/PERFORMANCE.md compares the two),
    # and by default go on spinning long after it, which, interleaved in one process, steals the
    # cores the next backend runs on (torch at 1x16 went from 15 to 570 ms). So each spins within
    # a call and sleeps within ~2 ms of its end: TVM's pools as the server's
    # (`limit_pool_spinning`), libgomp under torch after `TORCH_SPIN_COUNT` spins, ORT's pool stops
    # at the end of each run (`onnx_peer`). The warm call before each timed one absorbs the rest.
    limit_pool_spinning()
    os.environ.setdefault("GOMP_SPINCOUNT", str(TORCH_SPIN_COUNT))
    import torch

    from artifact.loader import load_artifact
    from compile.checkpoint import INPUT_NAMES, example_inputs, inspect_checkpoint, load_wrapper
    from compile.timing import interleaved_medians

    torch.set_num_threads(args.threads)
    try:
        model = load_artifact(args.artifacts)
        others = {f"tvm_bucket[{path.name}]": load_artifact(path) for path in args.compare}
    except ArtifactError as exc:
        return _fail(str(exc), 2)
    manifest = model.manifest
    if manifest.quantization is not None:
        return _fail(f"{args.artifacts} is int8; give the fp32 artifact as --artifacts and the int8 one as --compare", 2)
    int8_labels = {label for label, other in others.items() if other.manifest.quantization is not None}
    if manifest.sparsity is not None and manifest.sparsity.mode == "pruned":
        return _fail(f"{args.artifacts} is pruned, so PyTorch eager on its checkpoint is not its reference; "
                     "time sparse builds with python -m loadtest.sparse_bench", 2)
    tolerance = TOLERANCE[manifest.dtype]
    on_gpu = manifest.target.kind == "cuda"
    torch_device = "cuda" if on_gpu else "cpu"
    info = inspect_checkpoint(Path(manifest.model.path), manifest.task, manifest.pooling if manifest.task == "embed" else "auto")
    wrapper = load_wrapper(info, manifest.task, manifest.dtype).to(torch_device)
    sdpa = load_wrapper(info, manifest.task, manifest.dtype, attention="sdpa").to(torch_device)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    log(f"bench: peak {manifest.dtype} GEMM on {torch_device} ...")
    peak = matmul_peak_gflops(args.threads, torch_device, manifest.dtype)
    sessions, ort_fused_attention = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        if not (args.no_onnx or on_gpu):
            from .onnx_peer import onnx_sessions

            log(f"bench: ONNX Runtime{' fp32 and int8' if args.onnx_int8 else ''}, plain and optimized graphs ...")
            sessions, ort_fused_attention = onnx_sessions(wrapper, Path(scratch), args.threads, info.config,
                                                          args.onnx_int8)
            int8_labels |= {label for label in sessions if label.startswith("onnxruntime_int8")}

        compiled_wrapper = torch.compile(wrapper) if args.torch_compile else None
        results = []
        for index, (shape, kind) in enumerate(shapes, 1):
            inputs = [x.numpy() for x in example_inputs(shape.batch, shape.seq, manifest.model.vocab_size, seed=index)]
            ids, mask = inputs[0], inputs[1]
            served_by = model.run(ids, mask).path
            tensors = [torch.from_numpy(x).to(torch_device) for x in inputs]
            # Every candidate returns its output on the host, so GPU timings include the sync.
            candidates = {
                "tvm_bucket": lambda: model.run(ids, mask),
                "tvm_generic": lambda: model.run_generic(ids, mask),
                "torch_eager": lambda: wrapper(*tensors).cpu(),
                "torch_sdpa": lambda: sdpa(*tensors).cpu(),
            }
            for label, other in others.items():
                candidates[label] = lambda other=other: other.run(ids, mask)
            if compiled_wrapper is not None:
                candidates["torch_compile"] = lambda: compiled_wrapper(*tensors).cpu()
            feed = dict(zip(INPUT_NAMES, inputs))
            for label, session in sessions.items():
                candidates[label] = lambda session=session: session.run(None, feed)
            with torch.no_grad():
                outputs = {label: as_array(run()) for label, run in candidates.items()}
            reference = outputs["torch_eager"]
            diffs = agreement({k: v for k, v in outputs.items() if k not in int8_labels | {"torch_eager"}}, reference)
            wrong = [f"{label} (max abs diff {diff:.3g})" for label, diff in diffs.items() if not diff <= tolerance]
            cosines = {label: least_cosine(outputs[label], reference) for label in int8_labels}
            wrong += [f"{label} (cosine {cos:.4f} < {INT8_LEAST_COSINE})" for label, cos in cosines.items()
                      if not cos >= INT8_LEAST_COSINE]
            if wrong:
                return _fail(f"at {shape.name}, {', '.join(wrong)} disagree with PyTorch eager beyond "
                             f"{tolerance:g} ({manifest.dtype}); nothing timed", 1)
            log(f"bench [{index}/{len(shapes)}] {shape.name} ({kind}, served by {served_by}), "
                f"agree within {max(diffs.values()):.1e}, {args.repeats} rounds ...")
            with torch.no_grad():
                stats = interleaved_medians(candidates, args.repeats, warm_calls=args.warm_calls)
            flops = bert_flops(info.config, [int(length) for length in mask.sum(axis=1)])
            row = {"shape": shape.name, "kind": kind, "served_by": served_by, "gflop": flops / 1e9,
                   "agreement": diffs, "int8_least_cosine": cosines, "stats": stats}
            row["peers"] = peers = best_peers(stats)
            row["ratio_vs_torch"] = {k: v["median_s"] / stats[peers["torch"]]["median_s"] for k, v in stats.items()}
            for group in ("onnxruntime", "onnxruntime_int8"):
                if group in peers:
                    best = stats[peers[group]]["median_s"]
                    row[f"ratio_vs_{group}"] = {k: v["median_s"] / best for k, v in stats.items()}
            row["gflops"] = {k: flops / v["median_s"] / 1e9 for k, v in stats.items()}
            row["generic_vs_bucket"] = stats["tvm_generic"]["median_s"] / stats["tvm_bucket"]["median_s"]
            results.append(row)
            log("  " + ", ".join(f"{k} {v['median_s'] * 1e3:.1f} ms" for k, v in stats.items()))

    report = {
        "command": f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {**describe_machine(), "mcpu": manifest.target.mcpu,
                    "gpu": torch.cuda.get_device_name(0) if on_gpu else None,
                    "threads": args.threads, "peak_gemm_gflops": peak}, "warm_calls": args.warm_calls,
        "dtype": manifest.dtype, "tolerance": tolerance,
        "versions": {"tvm": manifest.tvm_version, "torch": torch.__version__,
                     "onnxruntime": _version("onnxruntime") if sessions else None},
        "onnxruntime_attention_fused": ort_fused_attention,
        "artifact": str(args.artifacts), "compared": [str(p) for p in args.compare], "int8": sorted(int8_labels),
        "repeats": args.repeats, "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(results, args.out / "bench.png", peak)
    table = markdown_table(report)
    (args.out / "bench.md").write_text(table + "\n")
    print(table)
    return 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def markdown_table(report: dict) -> str:
    """Medians per candidate, then each compiled candidate against the fastest peer of its precision."""
    backends = list(report["results"][0]["stats"])
    header = ("| shape | served by | " + " | ".join(f"{b} ms" for b in backends)
              + " | bucket / best PyTorch | bucket / best ORT fp32 | generic / bucket | bucket GFLOP/s of real tokens (% peak) |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    peak = report["machine"]["peak_gemm_gflops"]
    for row in report["results"]:
        times = " | ".join(f"{row['stats'][b]['median_s'] * 1e3:.1f}" for b in backends)
        vs_ort = row.get("ratio_vs_onnxruntime", {}).get("tvm_bucket")
        gflops = row["gflops"]["tvm_bucket"]
        lines.append(
            f"| {row['shape']} ({row['kind']}) | {row['served_by']} | {times} | {row['ratio_vs_torch']['tvm_bucket']:.2f}x | "
            f"{'n/a' if vs_ort is None else f'{vs_ort:.2f}x'} | {row['generic_vs_bucket']:.2f}x | {gflops:.0f} ({100 * gflops / peak:.0f}%) |"
        )
    compiled = [b for b in backends if b.startswith("tvm_")]
    int8 = set(report.get("int8", []))
    if "onnxruntime" not in report["results"][0].get("peers", {}):
        return "\n".join(lines)
    lines += ["", "Each compiled candidate's time over the fastest ONNX Runtime of its precision (which graph, and "
              "for int8 the least cosine of an output row to PyTorch fp32):", "",
              "| shape | " + " | ".join(compiled) + " |", "|" + "---|" * (len(compiled) + 1)]
    for row in report["results"]:
        cells = []
        for label in compiled:
            group = "onnxruntime_int8" if label in int8 else "onnxruntime"
            ratio = row.get(f"ratio_vs_{group}", {}).get(label)
            cosine = f", cos {row['int8_least_cosine'][label]:.4f}" if label in int8 else ""
            cells.append("n/a" if ratio is None else f"{ratio:.2f}x {row['peers'][group]}{cosine}")
        lines.append(f"| {row['shape']} | " + " | ".join(cells) + " |")
    peers_int8 = [b for b in backends if b.startswith("onnxruntime_int8")]
    if peers_int8:
        lines += ["", "ONNX Runtime int8, least cosine of an output row to PyTorch fp32: " + "; ".join(
            f"{row['shape']} " + ", ".join(f"{label} {row['int8_least_cosine'][label]:.4f}" for label in peers_int8)
            for row in report["results"])]
    return "\n".join(lines)


def _plot(results: list[dict], path: Path, peak: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = list(results[0]["stats"])
    width = 0.8 / len(backends)
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(results), 4.5))
    for i, backend in enumerate(backends):
        xs = [j + i * width for j in range(len(results))]
        ax.bar(xs, [r["stats"][backend]["median_s"] * 1e3 for r in results], width, label=backend)
    ax.set_xticks([j + width * (len(backends) - 1) / 2 for j in range(len(results))])
    ax.set_xticklabels([f"{r['shape']}\n({r['kind']})" for r in results])
    ax.set_yscale("log")
    ax.set_ylabel("median latency, ms (log)")
    ax.set_title(f"per-call latency (peak GEMM {peak:.0f} GFLOP/s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
