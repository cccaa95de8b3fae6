"""What a target's CPU runs, asked once per target: every kernel choice, refusal and manifest record
reads it here, and `KernelConfig` carries it (with the arithmetic chosen for one library) down to the
kernels.

LLVM answers each feature question in about a millisecond and the C compiler builds the bf16 and AMX
micro-kernels in about half a second each, while a compile asks for every kernel it schedules: so the answers are
taken once per target (`Capabilities.of`, by the target's text) and kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm

from .kernels import amx, attention_amx, attention_bf16, attention_int8, bf16, int8
from .precision import PRECISIONS

# what each reduced arithmetic of attention's products falls back to where its kernel lacks a head size
_FALLBACKS = {"amx": ("amx", "bf16"), "bf16": ("bf16",), "int8": ("int8",)}
_SUPPORTS = {"amx": attention_amx.supports, "bf16": attention_bf16.supports, "int8": attention_int8.supports}


def cpu_name(target: tvm.target.Target) -> str:
    """The CPU a target's (host) code is for, as messages name it: `znver4`, or `emeraldrapids
    (without avx512bf16, amx-tile)` where features of the model are turned off."""
    llvm = target.host or target
    turned_off = [attr[1:] for attr in llvm.attrs.get("mattr", []) if attr.startswith("-")]
    mcpu = llvm.attrs.get("mcpu", "?")
    return f"{mcpu} (without {', '.join(turned_off)})" if turned_off else mcpu


@dataclass(frozen=True)
class Capabilities:
    """One target's CPU as the kernels see it: its vector width, its int8 micro-kernel, whether it runs
    the bf16 and AMX ones; from those, the precisions it runs and the arithmetic of attention's products
    at each head size."""

    cpu: str  # as messages name it (`cpu_name`)
    llvm: bool  # whether the libraries' kernels are the CPU's (an llvm target; CUDA's are dlight's)
    lanes: int  # fp32 lanes of one SIMD register: 16 with AVX-512, 8 with AVX2, else 4 (SSE / NEON)
    int8_kernel: int8.Int8Kernel | None  # the best int8 micro-kernel (None: no AVX2)
    bf16_instructions: bool  # AVX512_BF16: what the bf16 micro-kernels run on
    bf16_build_error: str | None  # why the C compiler cannot build the bf16 micro-kernels (None: it can)
    amx: bool  # AMX-BF16 and AMX-INT8, and the C compiler builds the tiles: bf16 and int8 linears run on them

    @classmethod
    def of(cls, target: tvm.target.Target) -> Capabilities:
        """`target`'s capabilities, asked once per process for each target."""
        key = str(target)
        if key not in _BY_TARGET:
            _BY_TARGET[key] = cls.asked_of(target)
        return _BY_TARGET[key]

    @classmethod
    def asked_of(cls, target: tvm.target.Target) -> Capabilities:
        """`target`'s capabilities asked of LLVM and the C compiler now (`of` keeps them)."""
        llvm = target.host or target  # the CPU that runs the host code, a CUDA target's too
        on_cpu = llvm.kind.name == "llvm"

        def has(*features: str) -> bool:
            from tvm.target.codegen import llvm_cpu_has_features

            return on_cpu and all(llvm_cpu_has_features(feature, llvm) for feature in features)

        kernels = target.kind.name == "llvm"
        # `llvm_get_vector_width` is no help for the lanes: it answers 512 even for AVX2-only CPUs
        lanes = (16 if has("avx512f") else 8 if has("avx2") else 4) if kernels else 4
        int8_kernel = next((k for k in int8.KERNELS if has(*k.features)), None) if kernels else None
        bf16_instructions = has(*bf16.REQUIRED_FEATURES)
        return cls(cpu_name(target), kernels, lanes, int8_kernel, bf16_instructions,
                   _build_error(bf16.kernels_object) if bf16_instructions else None,
                   has(*amx.REQUIRED_FEATURES) and _build_error(amx.kernels_object) is None)

    @property
    def bf16(self) -> bool:
        """Whether the bf16 linears and attention products run here."""
        return self.bf16_instructions and self.bf16_build_error is None

    @property
    def int8_on_amx(self) -> bool:
        """Whether the int8 linears run on AMX's int8 tile (`int8.on_amx`)."""
        return int8.on_amx(self.int8_kernel, self.amx)

    def bf16_refusal(self, option: str, alternatives: str) -> str | None:
        """Why this CPU cannot run what `option` asks in bf16 (one line, naming `alternatives`), or None."""
        if not self.bf16_instructions:
            return f"{option} needs a CPU with AVX512_BF16; mcpu {self.cpu} has none (use {alternatives})"
        return f"{option}: {self.bf16_build_error}" if self.bf16_build_error else None

    def refusal(self, precision: str) -> str | None:
        """Why this target cannot run `--precision precision` (one line), or None when it can."""
        if precision == "bf16":
            return self.bf16_refusal("--precision bf16", "fp32, int8 or auto")
        if precision == "int8" and self.int8_kernel is None:
            return f"--precision int8 needs a CPU with AVX2; mcpu {self.cpu} has none"
        return None

    @property
    def precisions(self) -> list[str]:
        """The precisions `--precision auto` considers: every one the target runs (most accurate first)."""
        return [p for p in PRECISIONS if self.refusal(p) is None] if self.llvm else ["fp32"]

    def linears_kernel(self, precision: str) -> str | None:
        """The micro-kernel `precision`'s linears run on, as the manifest names it (None: fp32)."""
        if precision == "int8":
            return amx.INT8_DESCRIPTION if self.int8_on_amx else self.int8_kernel.description
        if precision == "bf16":
            return amx.BF16_DESCRIPTION if self.amx else bf16.DESCRIPTION
        return None

    @property
    def reduced_products(self) -> tuple[str, ...]:
        """The arithmetic below fp32 this CPU can run attention's products in, at some head size: "amx"
        on AMX tiles or else "bf16" on AVX512_BF16, and "int8" where the int8 linears' kernel works on the
        target's full vector width (AVX2, or AVX512BW: kernels/attention_int8.py)."""
        rounded = ("amx" if self.amx else "bf16",) if self.bf16 else ()
        int8_fills = self.int8_kernel is not None and self.int8_kernel.lanes == self.lanes
        return rounded + (("int8",) if int8_fills else ())

    def attention_products(self, head_size: int) -> tuple[str, ...]:
        """The arithmetic below fp32 the fused attention kernel runs its products in on this CPU for
        heads `head_size` wide: AMX's where the tiles take the head (whole tile rows: 32, 64 or 128
        dims), else the AVX-512 bf16 ones where compiled for it, and int8 where compiled for it. The one
        place the fallback amx -> bf16 -> fp32 is decided: the kernel runs what this names."""
        runs = (next((p for p in _FALLBACKS[reduced] if _SUPPORTS[p](head_size, self.lanes)), None)
                for reduced in self.reduced_products)
        return tuple(products for products in runs if products is not None)


_BY_TARGET: dict[str, Capabilities] = {}


def _build_error(build) -> str | None:
    """Why `build` (a micro-kernels' object) fails with this C compiler, or None where it builds."""
    try:
        build()
    except RuntimeError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class KernelConfig:
    """What one library's kernels are written for: the target's capabilities and the arithmetic chosen
    for this library. It travels from the compile down to the kernels (build -> schedule ->
    FuseAttention -> the attention kernel) in place of loose strings."""

    capabilities: Capabilities
    linears: str = "fp32"  # the linears' precision: "fp32", "bf16" or "int8"
    products: str = "fp32"  # attention's two products: "fp32", "bf16", "amx" or "int8" (attention_products.py)
    fused_attention: bool = True  # False: attention stays the imported ops (the fused kernel's reference)

    @classmethod
    def of(cls, target: tvm.target.Target, **chosen) -> KernelConfig:
        """The kernels for `target` with the `chosen` arithmetic (fp32 where not given)."""
        return cls(Capabilities.of(target), **chosen)
