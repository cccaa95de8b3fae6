"""`python -m loadtest.sparse_kernels`: the block-sparse kernels of one weight per BERT-base linear shape,
timed interleaved against each other, the dense kernels at fp32 / bf16 / int8, and the TIR kernel over fp32
BSR (compile/kernels/sparse.py), at each row count: what `SparseChoice` times one weight by, for a table.

Weights are random, 1 - `--sparsity` of their blocks kept (magnitude), so the numbers are the kernels'
alone; run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SHAPES = ((3072, 768), (768, 3072), (768, 768))  # BERT-base's FFN in, FFN out, attention output


def kernel_calls(weight: np.ndarray, block: tuple[int, int], rows: int, target) -> dict:
    """{name: a call of it on `rows` activation rows}: dense at each precision the CPU runs, each sparse
    storage that fits, and the TIR kernel."""
    import tvm

    from compile import sparse_choice
    from compile.capabilities import Capabilities
    from compile.kernels import bsr, sparse
    from compile.lowering import tir_pipeline
    from compile.phases.transform import linear_passes

    calls = {}
    for precision in Capabilities.of(target).precisions:
        run = sparse_choice.dense_linear(weight.shape, precision, str(target), linear_passes)
        x, w = (tvm.runtime.tensor(a) for a in (np.ones((rows, weight.shape[1]), np.float32), weight))
        calls[f"dense-{precision}"] = lambda run=run, x=x, w=w: run(x, w)
    names = [n for n in sparse_choice.candidates(weight.shape, block, target) if n != sparse_choice.DENSE]
    for name in names:
        calls[name] = sparse_choice.timed_call(name, weight, block, "fp32", target, linear_passes, rows)
    n, k = weight.shape
    data, indices, indptr = bsr.to_bsr(weight, block)
    kernel = sparse.bsr_matmul_cpu(rows, k, len(indices), block, n // block[0], "float32",
                                   Capabilities.of(target).lanes)
    built = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target,
                        tir_pipeline=tir_pipeline(target))
    args = [tvm.runtime.tensor(a) for a in (np.ones((rows, k), np.float32), data, indices, indptr,
                                            np.zeros((rows, n // block[0], block[0]), np.float32))]
    calls["tir-f32"] = lambda: built["main"](*args)
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.sparse_kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--blocks", default="16x1,32x1,16x4")
    parser.add_argument("--rows", default="16,128,512")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/sparse-kernels.json"))
    args = parser.parse_args(argv)
    from compile.build import make_target
    from compile.passes.sparsity import prune_blocks
    from compile.timing import interleaved_medians, use_all_cores

    target, threads = make_target("cpu"), use_all_cores()
    results = []
    for block in (tuple(int(v) for v in b.split("x")) for b in args.blocks.split(",")):
        for n, k in SHAPES:
            weight = prune_blocks(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32),
                                  1 - args.sparsity, block)
            for rows in (int(r) for r in args.rows.split(",")):
                stats = interleaved_medians(kernel_calls(weight, block, rows, target), args.repeats, warmup=2,
                                            warm_calls=1)
                row = {"block": list(block), "n": n, "k": k, "rows": rows,
                       "ms": {name: round(s["median_s"] * 1e3, 4) for name, s in stats.items()}}
                results.append(row)
                print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": threads, "sparsity": args.sparsity, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
