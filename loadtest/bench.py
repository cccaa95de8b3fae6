"""`python -m loadtest.bench`: compiled bucket vs generic library vs PyTorch, ONNX Runtime and OpenVINO.

One process, one thread count for every backend, interleaved repeated runs, medians and
ratios per shape, GFLOP/s against this machine's measured fp32 matmul peak. Before timing a
shape, every candidate's output is compared with PyTorch eager's: its largest absolute difference
(`agreement`) and its least cosine per output row (`least_cosine`) go into the JSON, and an fp32
candidate beyond the dtype's tolerance, or a bf16 / int8 one under `LEAST_COSINE`, stops the
benchmark (exit 1): a fast wrong answer is not a result. Writes JSON, a
PNG bar chart and a markdown table. Exit 2 when an artifact directory cannot be loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .arguments import at_least_one
from .machine import describe as describe_machine
from .machine import line as machine_line

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
# A reduced-precision candidate agrees when every output row is this close in direction to PyTorch
# fp32: far from what wrong weights give, loose enough for ONNX Runtime's dynamic int8 on random
# token ids (0.97 at 32x128 here) and OpenVINO NNCF int8 (0.935 at 1x512); each least cosine is reported.
LEAST_COSINE = {"bf16": 0.99, "fp16": 0.99, "int8": 0.9}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, required=True, help="compiled artifact directory")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="BxS shapes, ideally buckets of the artifact")
    parser.add_argument("--generic-shapes", default=DEFAULT_GENERIC_SHAPES,
                        help="non-bucket shapes: generic library vs the bucket that would serve them padded (empty: none)")
    parser.add_argument("--repeats", type=at_least_one, default=10)
    parser.add_argument("--threads", type=at_least_one, default=2)
    parser.add_argument("--warm-calls", type=int, default=1,
                        help="untimed calls of a candidate before each timed one, so that it runs with its own "
                             "weights in the caches, as a server between requests (0: right after another runtime)")
    parser.add_argument("--no-onnx", action="store_true", help="skip ONNX Runtime (always skipped on CUDA)")
    parser.add_argument("--no-openvino", action="store_true", help="skip OpenVINO (always skipped on CUDA)")
    parser.add_argument("--int8", action="store_true",
                        help="also the int8 peers: ONNX Runtime int8 (quantize_dynamic, QInt8 per channel) on the plain "
                             "export and on the transformers-optimized graph, OpenVINO NNCF int8 (transformer preset)")
    parser.add_argument("--torch-compile", action="store_true", help="also time torch.compile(wrapper)")
    parser.add_argument("--time", type=_labels, metavar="LABELS",
                        help="comma-separated candidates to time, such as tvm_bucket,openvino (default: every one); "
                             "the others still run once, for the agreement check (PyTorch eager is the reference): "
                             "for shapes where their calls take minutes")
    parser.add_argument("--compare", type=Path, action="append", default=[], metavar="ARTIFACTS",
                        help="another artifact of the same model (e.g. built without CUDA graphs) whose "
                             "libraries join the interleaved runs; repeatable")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/cpu"), help="directory for JSON + PNG")
    return parser.parse_args(argv)


def _labels(text: str) -> tuple[str, ...]:
    labels = tuple(label.strip() for label in text.split(",") if label.strip())
    if "tvm_bucket" not in labels:
        raise argparse.ArgumentTypeError("must include tvm_bucket, the artifact under test")
    return labels


def bert_flops(config: dict, lengths: list[int]) -> float:
    """Multiply-adds x 2 of the encoder's matmuls (linear layers + attention) over each sequence's
    real tokens: the work every candidate must do, whatever padding it computes besides."""
    def value(*keys):  # BERT, RoBERTa and XLM-R's key, then DistilBERT's
        return next(config[key] for key in keys if key in config)

    hidden, inter = value("hidden_size", "dim"), value("intermediate_size", "hidden_dim")
    layers = value("num_hidden_layers", "n_layers")
    gated = config.get("model_type") == "modernbert"  # GeGLU: two input projections, then the output one
    linear = 2 * sum(lengths) * (4 * hidden * hidden + (3 if gated else 2) * hidden * inter)

    def attention(reach: int) -> int:  # each query's keys: every one, or a sliding window's
        return 2 * 2 * sum(length * min(length, reach) for length in lengths) * hidden

    windows = [layer == "sliding_attention" for layer in config.get("layer_types") or []]
    window_keys = int(config.get("local_attention", 0)) + 1
    return float(layers * linear + sum(attention(window_keys if windowed else max(lengths, default=0))
                                       for windowed in windows + [False] * (layers - len(windows))))


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


def best_peers(stats: dict, precisions: dict[str, str]) -> dict[str, str]:
    """The fastest candidate of each peer: PyTorch (eager or SDPA attention, torch.compile), ONNX
    Runtime fp32 and int8 (plain or optimized graph), OpenVINO at its default precision, at f32 and
    NNCF int8. Ratios are taken against these."""
    groups = {"torch": [k for k in stats if k.startswith("torch_")],
              "onnxruntime": [k for k in stats if k.startswith("onnxruntime") and precisions.get(k) == "fp32"],
              "onnxruntime_int8": [k for k in stats if k.startswith("onnxruntime") and precisions.get(k) == "int8"],
              **{label: [label] for label in ("openvino", "openvino_f32", "openvino_int8", "openvino_int8_sparse")
                 if label in stats}}
    return {group: min(labels, key=lambda k: stats[k]["median_s"]) for group, labels in groups.items() if labels}


def peer_of_precision(precision: str) -> dict[str, str]:
    """For a candidate of `precision`: the ONNX Runtime and OpenVINO peer groups it is held against."""
    return {"onnxruntime": "onnxruntime_int8" if precision == "int8" else "onnxruntime",
            "openvino": {"fp32": "openvino_f32", "int8": "openvino_int8"}.get(precision, "openvino")}


def disagreements(precisions: dict[str, str], diffs: dict[str, float], cosines: dict[str, float],
                  tolerance: float) -> list[str]:
    """Candidates whose output is not the reference's: fp32 beyond `tolerance`, a reduced precision
    under its least cosine (`LEAST_COSINE`)."""
    wrong = []
    for label, diff in diffs.items():
        bound = LEAST_COSINE.get(precisions[label])
        if bound is None and not diff <= tolerance:
            wrong.append(f"{label} (max abs diff {diff:.3g})")
        elif bound is not None and not cosines[label] >= bound:
            wrong.append(f"{label} ({precisions[label]} cosine {cosines[label]:.4f} < {bound})")
    return wrong


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass
class Candidates:
    """Everything timed: the artifact under test (bucket and generic library), the compared
    artifacts, PyTorch, and the peers' sessions, with what each computes in."""

    model: object
    others: dict[str, object]
    wrapper: object
    sdpa: object
    compiled_wrapper: object | None
    sessions: dict[str, object]
    openvino: dict[str, object]
    precisions: dict[str, str]
    info: object
    ort_fused_attention: dict[str, int]

    def calls(self, inputs: list[np.ndarray], tensors: list) -> dict[str, Callable[[], object]]:
        """Each candidate's call on one batch; every one returns its output on the host."""
        from compile.checkpoint import INPUT_NAMES

        ids, mask = inputs[0], inputs[1]
        calls = {"tvm_bucket": lambda: self.model.run(ids, mask),
                 "tvm_generic": lambda: self.model.run_generic(ids, mask),
                 "torch_eager": lambda: self.wrapper(*tensors).cpu(),
                 "torch_sdpa": lambda: self.sdpa(*tensors).cpu()}
        for label, other in self.others.items():
            calls[label] = lambda other=other: other.run(ids, mask)
        if self.compiled_wrapper is not None:
            calls["torch_compile"] = lambda: self.compiled_wrapper(*tensors).cpu()
        feed = dict(zip(INPUT_NAMES, inputs))
        for label, session in self.sessions.items():
            calls[label] = lambda session=session: session.run(None, feed)
        for label, model in self.openvino.items():
            calls[label] = lambda model=model: model(feed)
        return calls

    def aliases(self) -> dict[str, str]:
        """{label: the label timed for it}: candidates that are one model under two names (OpenVINO's
        default where it is f32) are timed once."""
        first = {}
        for label, model in self.openvino.items():
            first.setdefault(id(model), label)
        return {label: first[id(model)] for label, model in self.openvino.items() if first[id(model)] != label}


def check_arguments(args) -> list[tuple[object, str]] | str:
    """The shapes to time, or why the arguments cannot be benchmarked (one line)."""
    from artifact.errors import ArtifactError
    from compile.bucketing import parse_buckets
    from compile.errors import CompileError

    from .strategy_table import read_manifest

    try:
        shapes = [(s, "bucket") for s in parse_buckets(args.shapes)] + [
            (s, "generic") for s in (parse_buckets(args.generic_shapes) if args.generic_shapes.strip() else [])]
        manifests = [read_manifest(directory) for directory in (args.artifacts, *args.compare)]
    except (ArtifactError, CompileError) as exc:
        return str(exc)
    sparsity = manifests[0].sparsity
    if sparsity is not None and sparsity.mode == "pruned":
        return (f"{args.artifacts} is pruned, so PyTorch eager on its checkpoint is not its reference; "
                "time sparse builds with python -m loadtest.sparse_bench")
    return shapes


def limit_spinning() -> None:
    """Every runtime's idle workers spin between the parallel sections of a call (without it, a
    call waits for sleeping workers to wake at each one; docs/PERFORMANCE.md says how each runtime spins),
    and by default go on spinning long after it, which, interleaved in one process, steals the
    cores the next backend runs on (torch at 1x16 went from 15 to 570 ms). So each spins within
    a call and sleeps within ~2 ms of its end: TVM's pools as the server's
    (`limit_pool_spinning`), libgomp under torch after `TORCH_SPIN_COUNT` spins, ORT's pool stops
    at the end of each run (`onnx_peer`), OpenVINO's TBB workers sleep after a short spin. The
    warm call before each timed one absorbs the rest."""
    from artifact.cores import limit_pool_spinning

    limit_pool_spinning()
    os.environ.setdefault("GOMP_SPINCOUNT", str(TORCH_SPIN_COUNT))


def load_candidates(args, scratch: Path) -> Candidates:
    """Load the artifacts and PyTorch, and build the peers' sessions (ArtifactError: cannot load)."""
    import torch

    from artifact.loader import load_artifact
    from compile.checkpoint import load_wrapper

    from .onnx_peer import artifact_checkpoint

    torch.set_num_threads(args.threads)
    model = load_artifact(args.artifacts)
    others = {f"tvm_bucket[{path.name}]": load_artifact(path) for path in args.compare}
    manifest = model.manifest
    on_gpu = manifest.target.kind == "cuda"
    device = "cuda" if on_gpu else "cpu"
    info = artifact_checkpoint(manifest)
    wrapper = load_wrapper(info, manifest.task, manifest.dtype).to(device)
    sdpa = load_wrapper(info, manifest.task, manifest.dtype, attention="sdpa").to(device)
    precisions = {"tvm_bucket": manifest.linear_precision, "tvm_generic": manifest.linear_precision,
                  **{label: other.manifest.linear_precision for label, other in others.items()},
                  **dict.fromkeys(("torch_eager", "torch_sdpa", "torch_compile"),  # in the artifact's dtype
                                  "fp32" if manifest.dtype == "float32" else manifest.dtype)}
    sessions, fused, openvino = {}, {}, {}
    if not (args.no_onnx or on_gpu):
        from .onnx_peer import onnx_sessions

        _log(f"bench: ONNX Runtime{' fp32 and int8' if args.int8 else ''}, plain and optimized graphs ...")
        sessions, fused = onnx_sessions(wrapper, scratch, args.threads, info.config, args.int8)
        precisions.update({label: "int8" if "int8" in label else "fp32" for label in sessions})
    if not (args.no_openvino or on_gpu):
        from .onnx_peer import export_onnx
        from .openvino_peer import openvino_models

        _log(f"bench: OpenVINO default precision and f32{' and NNCF int8' if args.int8 else ''} ...")
        graph = scratch / "model.onnx"  # ONNX Runtime's plain export, when it ran
        graph = graph if graph.exists() else export_onnx(wrapper, graph)
        openvino = openvino_models(graph, args.threads, args.int8, info.tokenizer_file, info.max_seq)
        precisions.update({label: "int8" if label.startswith("openvino_int8") else ov.precision()
                           for label, ov in openvino.items()})
    compiled_wrapper = torch.compile(wrapper) if args.torch_compile else None
    return Candidates(model, others, wrapper, sdpa, compiled_wrapper, sessions, openvino, precisions, info, fused)


def time_shape(args, candidates: Candidates, shape, kind: str, seed: int, tolerance: float) -> dict | str:
    """One shape: every candidate checked against PyTorch eager, then timed interleaved; the
    result row, or why nothing was timed (one line)."""
    import torch

    from compile.checkpoint import example_inputs
    from compile.timing import interleaved_medians

    manifest = candidates.model.manifest
    inputs = [x.numpy() for x in example_inputs(shape.batch, shape.seq, manifest.model.vocab_size, seed=seed)]
    mask = inputs[1]
    served_by = candidates.model.run(inputs[0], mask).path
    tensors = [torch.from_numpy(x).to("cuda" if manifest.target.kind == "cuda" else "cpu") for x in inputs]
    calls = candidates.calls(inputs, tensors)
    with torch.no_grad():
        outputs = {label: as_array(run()) for label, run in calls.items()}
    reference = outputs.pop("torch_eager")
    diffs = agreement(outputs, reference)
    cosines = {label: least_cosine(output, reference) for label, output in outputs.items()}
    wrong = disagreements(candidates.precisions, diffs, cosines, tolerance)
    if wrong:
        return (f"at {shape.name}, {', '.join(wrong)} disagree with PyTorch eager beyond "
                f"{tolerance:g} ({manifest.dtype}); nothing timed")
    _log(f"bench {shape.name} ({kind}, served by {served_by}), fp32 candidates agree within "
         f"{max(d for k, d in diffs.items() if candidates.precisions[k] == 'fp32'):.1e}, {args.repeats} rounds ...")
    unknown = sorted(set(args.time or ()) - set(calls))
    if unknown:
        return f"--time names {', '.join(unknown)}, which this run has not (it has {', '.join(calls)})"
    wanted = timed_labels(args, calls)
    aliases = {alias: timed for alias, timed in candidates.aliases().items() if alias in wanted}
    timed = {k: v for k, v in calls.items() if (k in wanted or k in aliases.values()) and k not in aliases}
    with torch.no_grad():
        stats = interleaved_medians(timed, args.repeats, warm_calls=args.warm_calls)
    stats.update({alias: stats[timed] for alias, timed in aliases.items()})
    flops = bert_flops(candidates.info.config, [int(length) for length in mask.sum(axis=1)])
    row = {"shape": shape.name, "kind": kind, "served_by": served_by, "gflop": flops / 1e9,
           "agreement": diffs, "least_cosine": cosines, "stats": stats}
    row["peers"] = peers = best_peers(stats, candidates.precisions)
    for group, best in peers.items():
        row[f"ratio_vs_{group}"] = {k: v["median_s"] / stats[best]["median_s"] for k, v in stats.items()}
    row["gflops"] = {k: flops / v["median_s"] / 1e9 for k, v in stats.items()}
    if "tvm_generic" in stats:
        row["generic_vs_bucket"] = stats["tvm_generic"]["median_s"] / stats["tvm_bucket"]["median_s"]
    _log("  " + ", ".join(f"{k} {v['median_s'] * 1e3:.1f} ms" for k, v in stats.items()))
    return row


def timed_labels(args, calls: dict) -> list[str]:
    """The candidates `--time` names (every one of `calls` where it names none)."""
    return [label for label in calls if args.time is None or label in args.time]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shapes = check_arguments(args)
    if isinstance(shapes, str):
        return _fail(shapes, 2)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # before TVM's thread pool starts
    limit_spinning()
    import torch

    from artifact.errors import ArtifactError

    with tempfile.TemporaryDirectory() as scratch:
        try:
            candidates = load_candidates(args, Path(scratch))
        except ArtifactError as exc:
            return _fail(str(exc), 2)
        manifest = candidates.model.manifest
        tolerance = TOLERANCE[manifest.dtype]
        _log(f"bench: peak {manifest.dtype} GEMM ...")
        on_gpu = manifest.target.kind == "cuda"
        peak = matmul_peak_gflops(args.threads, "cuda" if on_gpu else "cpu", manifest.dtype)
        results = []
        for index, (shape, kind) in enumerate(shapes, 1):
            row = time_shape(args, candidates, shape, kind, index, tolerance)
            if isinstance(row, str):
                return _fail(row, 1)
            results.append(row)

    report = {
        "command": f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {**describe_machine(), "mcpu": manifest.target.mcpu,
                    "gpu": torch.cuda.get_device_name(0) if on_gpu else None,
                    "threads": args.threads, "peak_gemm_gflops": peak}, "warm_calls": args.warm_calls,
        "dtype": manifest.dtype, "tolerance": tolerance, "least_cosine": LEAST_COSINE,
        "versions": {"tvm": manifest.tvm_version, "torch": torch.__version__,
                     "onnxruntime": _version("onnxruntime") if candidates.sessions else None,
                     "openvino": _version("openvino") if candidates.openvino else None},
        "onnxruntime_attention_fused": candidates.ort_fused_attention,
        "openvino_isa": {label: ov.isa() for label, ov in candidates.openvino.items()},
        "artifact": str(args.artifacts), "compared": [str(p) for p in args.compare],
        "precisions": {label: candidates.precisions[label] for label in
                       (*results[0]["stats"], *results[0]["least_cosine"])},
        "repeats": args.repeats, "results": results,
    }
    write_report(report, args.out, peak)
    return 0


def write_report(report: dict, out: Path, peak: float) -> None:
    """bench.json, bench.png and bench.md (the table also goes to stdout)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report["results"], out / "bench.png", peak)
    table = markdown_table(report)
    (out / "bench.md").write_text(table + "\n")
    print(table)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def markdown_table(report: dict) -> str:
    """Medians per candidate, then each compiled candidate against the peers of its precision, with
    every candidate's least cosine to PyTorch fp32 beside it."""
    backends = list(report["results"][0]["stats"])
    header = ("| shape | served by | " + " | ".join(f"{b} ms" for b in backends)
              + " | bucket / best PyTorch | bucket / best ORT fp32 | generic / bucket | bucket GFLOP/s of real tokens (% peak) |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    peak = report["machine"]["peak_gemm_gflops"]
    for row in report["results"]:
        times = " | ".join(f"{row['stats'][b]['median_s'] * 1e3:.1f}" for b in backends)
        ratios = [row.get("ratio_vs_torch", {}).get("tvm_bucket"), row.get("ratio_vs_onnxruntime", {}).get("tvm_bucket"),
                  row.get("generic_vs_bucket")]
        gflops = row["gflops"]["tvm_bucket"]
        lines.append(
            f"| {row['shape']} ({row['kind']}) | {row['served_by']} | {times} | "
            + " | ".join("n/a" if ratio is None else f"{ratio:.2f}x" for ratio in ratios)
            + f" | {gflops:.0f} ({100 * gflops / peak:.0f}%) |"
        )
    compiled = [b for b in backends if b.startswith("tvm_")]
    precisions = report["precisions"]
    lines += ["", "Each compiled candidate's time over the fastest ONNX Runtime and the OpenVINO of its precision "
              "(OpenVINO's default is bf16 where the CPU has it); least cosine of an output row to PyTorch fp32:", "",
              "| shape | " + " | ".join(f"{label} ({precisions[label]})" for label in compiled) + " |",
              "|" + "---|" * (len(compiled) + 1)]
    for row in report["results"]:
        cells = []
        for label in compiled:
            ratios = [f"{row[f'ratio_vs_{group}'][label]:.2f}x {row['peers'][group]}"
                      for group in peer_of_precision(precisions[label]).values() if f"ratio_vs_{group}" in row]
            if "openvino" in row["peers"] and precisions[label] != precisions.get("openvino"):
                ratios.append(f"{row['ratio_vs_openvino'][label]:.2f}x openvino ({precisions['openvino']})")
            cells.append(", ".join(ratios + [f"cos {row['least_cosine'][label]:.5f}"]))
        lines.append(f"| {row['shape']} | " + " | ".join(cells) + " |")
    peers = [label for label in report["results"][0]["least_cosine"] if not label.startswith("tvm_")]
    lines += ["", "Peers' least cosine of an output row to PyTorch fp32 (timed or not): " + "; ".join(
        f"{row['shape']} " + ", ".join(f"{label} ({precisions[label]}) {row['least_cosine'][label]:.5f}"
                                       for label in peers)
        for row in report["results"])]
    lines += ["", f"CPU: {machine_line(report['machine'])}"]
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
