"""Which kernel a sparse-enough linear runs on: dense at its precision, or block-sparse in one of the storages
this CPU runs (compile/kernels/bsr.py), the fastest that holds the accuracy gate.

The gate: a sparse kernel may lose no more than the dense kernel of the linear's precision, which the
compile's model-level gate admitted (fp32: only fp32 blocks; bf16: fp32 or bf16 blocks; int8: any). Each
candidate's loss is its output's relative error against x @ W^T in float64 on the same activations,
simulated in numpy by default (`simulated_errors`: what each kernel rounds, as it rounds it). Times come from
building each candidate for the target and timing it here (`measured_times`). Both are parameters of
`SparseChoice`, so the choice itself (`choose`) is tested under given times and errors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from tvm.target import Target

from .capabilities import Capabilities
from .kernels import bsr, int8

DENSE = "dense"
TIR = "bsr-tir"  # fp32 BSR on the TIR kernel
TIMED_ROWS = 128  # activation rows each candidate is timed on
ERROR_ROWS = 32
GATE_SLACK = 1.05  # a sparse candidate's error may exceed the dense one's by this factor (simulation noise)
FP32_ERROR = 1e-6  # what fp32 kernels differ by from float64: summation order only

# (names, dense precision) -> {name: ms}
Timer = Callable[[np.ndarray, tuple[int, int], list[str], str], dict[str, float]]
# (weight, block, names, dense precision) -> {name: relative error}
Accuracy = Callable[[np.ndarray, tuple[int, int], list[str], str], dict[str, float]]


def sparse_name(storage: str) -> str:
    return f"bsr-{storage}"


def storage_of(name: str) -> str | None:
    return name[len("bsr-"):] if name.startswith("bsr-") else None


def candidates(shape: tuple[int, int], block: tuple[int, int], target: Target) -> list[str]:
    """Dense, every sparse storage whose C kernel runs this weight on `target`'s CPU without padding, and the
    TIR kernel over fp32 BSR (compile/kernels/sparse.py: any block; CUDA's only one)."""
    n, k = shape
    capabilities = Capabilities.of(target)
    if not capabilities.llvm:
        return [DENSE, TIR]
    vnni = capabilities.int8_kernel is int8.VNNI
    fitting = [s for s in bsr.STORAGES if bsr.fits(s, block, capabilities.lanes, vnni, k, n)]
    return [DENSE, *(sparse_name(s) for s in fitting), TIR]


def untimed(names: list[str]) -> str:
    """What a sparse-enough weight runs on when nothing is timed: fp32 blocks, on the C kernel where it fits."""
    return sparse_name("f32") if sparse_name("f32") in names else TIR


# ----------------------------------------------------------------------------- accuracy


def _bf16(values: np.ndarray) -> np.ndarray:
    return bsr.stored_weight("bf16w", values)


def _rows_u8(x: np.ndarray) -> np.ndarray:
    """x per row onto u8 with a zero point and back (the int8 kernels' activations)."""
    lo, hi = np.minimum(x.min(axis=1, keepdims=True), 0), np.maximum(x.max(axis=1, keepdims=True), 0)
    scale = np.where(hi > lo, (hi - lo) / 255.0, 1.0)
    zero = np.rint(-lo / scale)
    return (np.clip(np.rint(x / scale) + zero, 0, 255) - zero) * scale


def _simulated(name: str, precision: str, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """What candidate `name` computes, in float64."""
    if name == DENSE:
        if precision == "bf16":
            return _bf16(x).astype(np.float64) @ _bf16(weight).astype(np.float64).T
        if precision == "int8":
            return _rows_u8(x) @ bsr.stored_weight("i8w", weight).astype(np.float64).T
        return (x.astype(np.float32) @ weight.T).astype(np.float64)
    storage = storage_of(name)
    if storage == "tir":
        return (x.astype(np.float32) @ weight.T).astype(np.float64)
    rows = _rows_u8(x) if storage in bsr.QUANTISED else x
    return rows @ bsr.stored_weight(storage, weight).astype(np.float64).T


def simulated_errors(weight: np.ndarray, block: tuple[int, int], names: list[str], precision: str) -> dict[str, float]:
    """Each candidate's relative error (Frobenius) against x @ W^T on random activations."""
    del block  # the blocks store the weight's values: their shape changes nothing
    x = np.random.default_rng(0).standard_normal((ERROR_ROWS, weight.shape[1]))
    exact = x @ weight.astype(np.float64).T
    norm = max(float(np.linalg.norm(exact)), 1e-30)
    return {name: max(float(np.linalg.norm(_simulated(name, precision, x, weight) - exact)) / norm, FP32_ERROR)
            for name in names}


# ----------------------------------------------------------------------------- time


def measured_times(target: Target, linear_passes: Callable) -> Timer:
    """Each candidate built for `target` and timed here on `TIMED_ROWS` rows (median ms, interleaved); the
    dense one through `linear_passes(arithmetic, target)`, the passes that put the libraries' linears on
    their precision's kernels (compile/phases/transform.py)."""
    from .timing import interleaved_medians

    def timer(weight: np.ndarray, block: tuple[int, int], names: list[str], precision: str) -> dict[str, float]:
        calls = {name: timed_call(name, weight, block, precision, target, linear_passes) for name in names}
        stats = interleaved_medians(calls, repeats=7, warmup=2, warm_calls=1)
        return {name: round(stats[name]["median_s"] * 1e3, 4) for name in names}

    return timer


def timed_call(name: str, weight: np.ndarray, block: tuple[int, int], precision: str, target: Target,
               linear_passes: Callable, rows: int = TIMED_ROWS) -> Callable[[], object]:
    """A call of candidate `name` for `weight` on `rows` activation rows, built for `target`."""
    import tvm

    x = tvm.runtime.tensor(np.random.default_rng(0).standard_normal((rows, weight.shape[1])).astype(np.float32))
    if name == DENSE:
        run = dense_linear(weight.shape, precision, str(target), linear_passes)
        w = tvm.runtime.tensor(weight)
        return lambda: run(x, w)
    from .kernels import sparse
    from .lowering import tir_pipeline

    n, k = weight.shape
    storage = storage_of(name)
    out_shape = (rows, n)
    if storage != "tir":
        packed = bsr.pack(storage, weight, block)
        arrays = list(packed.values())
        kernel = bsr.bsr_kernel(storage, rows, k, n, packed, block, Capabilities.of(target).lanes)
    else:
        arrays = list(bsr.to_bsr(weight, block))
        kernel = sparse.bsr_matmul_cpu(rows, k, len(arrays[1]), block, n // block[0], "float32",
                                       Capabilities.of(target).lanes)
        out_shape = (rows, n // block[0], block[0])
    built = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target,
                        tir_pipeline=tir_pipeline(target))
    args = [x, *(tvm.runtime.tensor(a) for a in arrays), tvm.runtime.tensor(np.zeros(out_shape, np.float32))]
    return lambda: built["main"](*args)


@functools.cache
def dense_linear(shape: tuple[int, int], precision: str, target_key: str, linear_passes: Callable) -> Callable:
    """x @ W^T as the libraries run it at `precision` (its passes, packing, lifting, the CPU pipeline), as a
    callable of (x, W): dense time depends on the shape alone, so one build serves every weight of it."""
    import tvm
    from tvm import relax

    from .build import relax_pipeline
    from .capabilities import KernelConfig
    from .int8_plan import Int8Plan
    from .lowering import tir_pipeline
    from .passes.lift import transform_weights
    from .plan import Arithmetic

    target = Target(target_key)
    n, k = shape
    m = tvm.tirx.Var("m", "int64")
    x, w = relax.Var("x", relax.TensorType((m, k), "float32")), relax.Var("w", relax.TensorType((n, k), "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x, w], attrs={"num_input": 1}):
        with builder.dataflow():
            y = builder.emit_output(builder.emit(relax.op.matmul(x, builder.emit(relax.op.permute_dims(w)))))
        builder.emit_func_output(y)
    plan = Int8Plan(alpha=0.0, scales={}, fallback=[], fallback_keys=set(), simulated={})
    passes = linear_passes(Arithmetic(precision, int8=plan), target)
    lifted = tvm.transform.Sequential([*passes, relax.transform.LiftTransformParams()])(builder.get())
    kernels = KernelConfig.of(target, linears=precision)
    _load_objects(kernels.capabilities)
    mod = transform_weights(lifted, [tvm.runtime.tensor(np.zeros(shape, np.float32))]).mod
    built = relax.VirtualMachine(tvm.compile(mod, target, relax_pipeline=relax_pipeline(target, kernels),
                                             tir_pipeline=tir_pipeline(target)), tvm.cpu())
    weights: dict[int, list] = {}

    def run(xs, ws):
        if id(ws) not in weights:  # the weight's transform (packing, quantization) once per weight
            weights[id(ws)] = [tvm.runtime.tensor(a) for a in transform_weights(lifted, [ws]).weights]
        return built["main"](xs, *weights[id(ws)])

    return run


def _load_objects(capabilities: Capabilities) -> None:
    """The C objects a library of this CPU may call, loaded for this process's JIT (a library links them)."""
    from .kernels.linking import library_objects
    from .kernels.objects import load_in_process

    for obj in library_objects(capabilities.int8_kernel):
        try:
            load_in_process(obj.build())
        except RuntimeError:  # a C compiler without the instruction set: nothing here calls it then
            continue


# ----------------------------------------------------------------------------- the choice


@dataclass(frozen=True)
class SparseChoice:
    """How the sparse pass decides: the block, the density above which a weight stays dense, the target,
    each weight's dense precision (by its parameter's name), and the sources of times (None: untimed, every
    sparse-enough weight on fp32 blocks) and errors."""

    block: tuple[int, int]
    max_density: float
    target: Target
    precision_of: Callable[[str], str] = lambda name: "fp32"
    timer: Timer | None = None
    accuracy: Accuracy = simulated_errors
    decided: dict = field(default_factory=dict)  # weight name -> `decide`'s record: each strategy's pass reuses it

    def decide(self, weight: np.ndarray, name: str) -> dict:
        """One weight's record: its candidates (ms, error, whether it holds the gate) and the choice."""
        if name not in self.decided:
            self.decided[name] = self._decide(weight, name)
        return self.decided[name]

    def _decide(self, weight: np.ndarray, name: str) -> dict:
        precision = self.precision_of(name)
        names = candidates(weight.shape, self.block, self.target)
        if self.timer is None:
            return {"precision": precision, "candidates": [], "chosen": untimed(names)}
        times = self.timer(weight, self.block, names, precision)
        errors = self.accuracy(weight, self.block, names, precision)
        return {"precision": precision, "chosen": choose(times, errors),
                "candidates": [{"name": n, "ms": times[n], "error": errors[n], "holds": holds(errors, n)}
                               for n in names]}


def holds(errors: dict[str, float], name: str) -> bool:
    """Whether `name` loses no more than the dense kernel (within `GATE_SLACK`)."""
    return name == DENSE or errors[name] <= errors[DENSE] * GATE_SLACK


def choose(times: dict[str, float], errors: dict[str, float]) -> str:
    """The fastest candidate that holds the gate; dense where nothing sparse beats it."""
    admitted = [name for name in times if holds(errors, name)]
    return min(admitted, key=lambda name: (times[name], name != DENSE))
