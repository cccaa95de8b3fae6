"""The arithmetic of attention's two products in a bf16 or int8 library, chosen by timing.

Rounding the products' operands to bf16 pays where the CPU's bf16 units outrun its fp32 FMAs,
as AMX tiles do, and costs where they do not: on an AMX Xeon, MiniLM's attention kernel (12 heads
of 32) took 0.40x the fp32 kernel's time on the tiles, and 1.22x on AVX512_BF16 `vdpbf16ps`
(`--mcpu cooperlake` code), which issues there at the FMA's rate (geometric means over one
sequence of 128 and of 512 tokens). Only the compiling CPU knows which, so the compile builds the
kernel at the model's head geometry in fp32 and in the CPU's bf16 arithmetic, times both, and
keeps bf16 only when it is faster by `precision.PRECISION_MARGIN`: fp32 is the more accurate, and
a difference within noise is no reason to round. Where the libraries cannot run here
(cross-compiled, not validated), nothing is timed and bf16 is kept where the CPU has it. fp32
libraries keep fp32 products.

int8 libraries may also have int8 products (kernels/attention_int8.py: `vpmaddubsw` at AVX2,
`vpdpbusd` on zmm with AVX512_VNNI), timed beside fp32 and bf16 and kept where fastest: on the
same Xeon with znver4's code the compile timed the int8 kernel at 0.62-0.68x the fp32 kernel's
time at heads of 64 and 32, and bf16 at 1.41-1.63x. The int8 plan simulates them (int8_simulation.Simulation): they cost
accuracy where bf16 ones do not, so where every linear in int8 beside them misses the gate, the
compile gives int8 libraries the products bf16 ones have instead (`AttentionChoice.without_int8`,
phases.decisions.plan_int8_linears).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tvm
from tvm import relax, tirx

from artifact.manifest import AttentionProductsEntry

from . import precision
from .build import build_library
from .capabilities import Capabilities, KernelConfig
from .checkpoint import CheckpointInfo
from .kernels import attention
from .kernels.attention import AttentionShape
from .timing import interleaved_medians
from .workers import Workers

TIMED_SEQS = (128, 512)  # one sequence of each, clipped to the model's bound: where attention weighs
TIMED_ROUNDS = 15  # interleaved rounds per length: the kernel takes 0.1-10 ms


@dataclass(frozen=True)
class Geometry:
    """What the timed kernel is written for: the model's heads and their width, its longest sequence."""

    heads: int
    head_size: int
    max_seq: int

    @classmethod
    def of(cls, info: CheckpointInfo) -> "Geometry":
        return cls(info.attention_heads, info.hidden_size // info.attention_heads, info.max_seq)


# The products each library precision's linears may sit beside: bf16 ones keep bf16 answers (int8
# products would cost the accuracy bf16 keeps); int8 ones any.
BESIDE = {"bf16": ("bf16", "amx"), "int8": ("bf16", "amx", "int8")}


@dataclass
class AttentionChoice:
    """Which arithmetic attention's products run in beside bf16 and beside int8 linears (by the
    linears' precision: "fp32", "bf16", "amx" or "int8"), what was asked, why (one line each) and the
    time of each candidate per timed sequence length (empty: not timed)."""

    products: dict[str, str]
    requested: str  # "auto", "fp32" or "bf16"
    reasons: dict[str, str]
    times_ms: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def alike(cls, products: str, requested: str, reason: str,
              times_ms: dict[str, dict[str, float]] | None = None) -> "AttentionChoice":
        """The same products, for the same reason, beside bf16 and int8 linears."""
        return cls(dict.fromkeys(BESIDE, products), requested, dict.fromkeys(BESIDE, reason), times_ms or {})

    @property
    def bf16_pays(self) -> bool | None:
        """Whether bf16 arithmetic outran fp32 in this CPU's timing (None: not timed), which the int8
        plan's units kept out of int8 follow too (int8_plan.kept_precision)."""
        return self.products["bf16"] in ("bf16", "amx") if self.times_ms else None

    def for_precision(self, name: str) -> str:
        """The products of a library whose linears are in `name` (fp32 ones keep fp32)."""
        return self.products.get(name, "fp32")

    def without_int8(self, measured: bool = True) -> "AttentionChoice":
        """Beside int8 linears, the products bf16 ones have (fp32, or bf16 where it paid) where the int8
        plan misses its gate with every linear in int8 beside int8 products (`measured`), or beside these
        already: keeping a linear out would cost more than the products save."""
        fallback = self.products["bf16"]
        why = ("with int8 products, int8 linears miss the gate" if measured else
               f"int8 linears miss the gate beside {fallback} products already, and int8 ones round more")
        return AttentionChoice({**self.products, "int8": fallback}, self.requested,
                               {**self.reasons, "int8": f"{fallback}: {why}"}, self.times_ms)

    def entry(self, name: str) -> AttentionProductsEntry:
        """The manifest's record for a library whose linears are in `name`."""
        return AttentionProductsEntry(products=self.for_precision(name), requested=self.requested,
                                      reason=self.reasons[name], times_ms=self.times_ms)


def refusal(requested: str, capabilities: Capabilities) -> str | None:
    """Why the CPU cannot run attention's products as `requested` (one line), or None."""
    return capabilities.bf16_refusal("--attention-products bf16", "fp32 or auto") if requested == "bf16" else None


def _candidates(capabilities: Capabilities, geometry: Geometry, requested: str) -> tuple[str, ...]:
    """The reduced products the fused kernel runs at the model's heads that `requested` allows."""
    return tuple(products for products in capabilities.attention_products(geometry.head_size)
                 if requested == "auto" or products != "int8")


def choose(target: tvm.target.Target, geometry: Geometry, requested: str, timed: bool,
           kernels: "StartedKernels | None" = None) -> AttentionChoice:
    """`requested` fp32 or bf16 as asked; auto: the fused kernel timed in fp32 and in each reduced
    arithmetic the CPU runs at the model's head size (when `timed`: the libraries run here; built
    already where `kernels` is given, `start_kernels`), the fastest kept per library precision
    (`decide`), else the CPU's bf16 where it has it, int8 beside int8 linears where not."""
    capabilities = Capabilities.of(target)
    reduced = capabilities.reduced_products
    if requested == "fp32" or not reduced:
        return AttentionChoice.alike("fp32", requested, "fp32: asked for" if requested == "fp32" else
                                     "fp32: no bf16 or int8 products here (AVX512_BF16, AVX2 or AVX512BW)")
    offered = tuple(products for products in reduced if requested == "auto" or products != "int8")
    candidates = _candidates(capabilities, geometry, requested)
    if not candidates:
        return AttentionChoice.alike("fp32", requested, f"fp32: the fused kernel's {' and '.join(offered)} products "
                                     f"do not take {geometry.head_size}-wide heads at {capabilities.lanes} lanes")
    if requested == "bf16":
        return AttentionChoice.alike(candidates[0], requested, f"{candidates[0]}: asked for")
    if not timed:
        why = "the CPU has it (not timed: the libraries do not run here)"
        products = {linears: next((p for p in candidates if p in allowed), "fp32")
                    for linears, allowed in BESIDE.items()}
        return AttentionChoice(products, requested, {linears: f"{p}: {why}" if p != "fp32" else
                                                     "fp32: no bf16 products here" for linears, p in products.items()})
    return decide(_time_kernels(target, geometry, ("fp32", *candidates), kernels))


def decide(times_ms: dict[str, dict[str, float]]) -> AttentionChoice:
    """Per library precision, fp32 unless the fastest of the products it may take (`BESIDE`; time:
    geometric mean over the timed lengths) is under fp32's by `PRECISION_MARGIN`: fp32 is the more
    accurate, and noise is no reason to round."""
    fp32 = _geometric_mean(times_ms["fp32"])
    products, reasons = {}, {}
    for linears, allowed in BESIDE.items():
        ratios = {name: _geometric_mean(times_ms[name]) / fp32 for name in allowed if name in times_ms}
        if not ratios:
            products[linears], reasons[linears] = "fp32", f"fp32: no {linears} products here"
            continue
        fastest = min(ratios, key=ratios.get)
        if ratios[fastest] < 1 - precision.PRECISION_MARGIN:
            products[linears], reasons[linears] = fastest, f"{fastest}: {ratios[fastest]:.2f}x the fp32 kernel's time"
        else:
            products[linears], reasons[linears] = "fp32", f"fp32: {fastest} takes {ratios[fastest]:.2f}x its time"
    return AttentionChoice(products, "auto", reasons, times_ms)


class StartedKernels:
    """The fused attention kernel in each candidate arithmetic, built in `workers` in one child, one
    after another: a compile starts them before it loads the model, whose load and import take one
    core for seconds, and times them when it chooses (`times`)."""

    JOB = "attention kernels"

    def __init__(self, target: tvm.target.Target, geometry: Geometry, candidates: tuple[str, ...],
                 workers: Workers, directory: Path):
        self.geometry, self.workers = geometry, workers
        self.paths = {products: directory / f"attention-{products}.so" for products in candidates}
        directory.mkdir(parents=True, exist_ok=True)

        def build_all() -> None:
            for products, path in self.paths.items():
                build_kernel(target, geometry, products, path)

        workers.submit(self.JOB, build_all)

    def times(self) -> dict[str, dict[str, float]]:
        """Median ms of each kernel per timed length, interleaved, once built and every build is done."""
        self.workers.idle()  # this build's failure raises here too
        seqs = sorted({min(seq, self.geometry.max_seq) for seq in TIMED_SEQS})
        kernels = {products: _TimedKernel(path, self.geometry) for products, path in self.paths.items()}
        times = {products: {} for products in self.paths}
        for seq in seqs:
            calls = {products: kernel.call_at(seq) for products, kernel in kernels.items()}
            for products, stats in interleaved_medians(calls, repeats=TIMED_ROUNDS).items():
                times[products][f"1x{seq}"] = round(stats["median_s"] * 1e3, 4)
        return times


def start_kernels(target: tvm.target.Target, geometry: Geometry, requested: str, workers: Workers,
                  directory: Path) -> StartedKernels | None:
    """The builds `choose(..., timed=True)` times, started now in `workers` (None: it times none)."""
    candidates = _candidates(Capabilities.of(target), geometry, requested) if requested == "auto" else ()
    return StartedKernels(target, geometry, ("fp32", *candidates), workers, directory) if candidates else None


def _time_kernels(target: tvm.target.Target, geometry: Geometry, candidates: tuple[str, ...],
                  kernels: StartedKernels | None = None) -> dict[str, dict[str, float]]:
    """Median ms of each candidate's kernel per timed length: `kernels`' where started, else built now."""
    if kernels is not None:
        return kernels.times()
    with tempfile.TemporaryDirectory(prefix="bert-attention-") as scratch, Workers() as workers:
        return StartedKernels(target, geometry, candidates, workers, Path(scratch)).times()


def _geometric_mean(times: dict[str, float]) -> float:
    return math.exp(sum(math.log(ms) for ms in times.values()) / len(times))


def build_kernel(target: tvm.target.Target, geometry: Geometry, products: str, path: Path) -> None:
    """The fused attention kernel alone (padded rows, one sequence of any length up to the model's),
    with `products`, built as a library is."""
    kernels = KernelConfig.of(target, products=products)
    build_library(kernel_module(geometry, kernels), target, path, kernels=kernels)


class _TimedKernel:
    """A built kernel (`build_kernel`) loaded, with random queries, keys and values."""

    def __init__(self, path: Path, geometry: Geometry):
        self.geometry = geometry
        self.vm = relax.VirtualMachine(tvm.runtime.load_module(str(path)), tvm.cpu())

    def call_at(self, seq: int):
        hidden = self.geometry.heads * self.geometry.head_size
        rng = np.random.default_rng(seq)
        qkv = tvm.runtime.tensor(rng.standard_normal((seq, 3 * hidden), dtype=np.float32))
        bias = tvm.runtime.tensor(np.zeros((1, 1, 1, seq), np.float32))
        return lambda: self.vm["main"](qkv, bias)


def kernel_module(geometry: Geometry, kernels: KernelConfig) -> tvm.IRModule:
    """`main(qkv, bias)`: one call of the kernel on Q, K and V at their offsets in one projection
    (built by `build.build_library`, whose pipeline leaves a written kernel as it is)."""
    heads, width = geometry.heads, geometry.head_size
    hidden = heads * width
    seq = tirx.Var("seq", "int64")
    shape = AttentionShape(batch=1, seq=tirx.Var("s", "int64"), rows=tirx.Var("rows", "int64"), heads=heads,
                           head_size=width, max_seq=geometry.max_seq, scale=1 / math.sqrt(width), packed=False,
                           widths=(3 * hidden,) * 3, offsets=(0, hidden, 2 * hidden))
    bb = relax.BlockBuilder()
    qkv = relax.Var("qkv", relax.TensorType((seq, 3 * hidden), "float32"))
    bias = relax.Var("bias", relax.TensorType((1, 1, 1, seq), "float32"))
    with bb.function("main", [qkv, bias]):
        with bb.dataflow():
            kernel = bb.add_func(attention.write_attention(shape, kernels), attention.KERNEL_NAME)
            out = bb.emit_output(relax.call_tir(kernel, [qkv, qkv, qkv, bias],
                                                relax.TensorType((seq, hidden), "float32")))
        bb.emit_func_output(out)
    return bb.get()
