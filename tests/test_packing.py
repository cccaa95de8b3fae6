"""compile/passes/packing.py: linear weights packed at load into the CPU kernel's panels.

Counts of ops before and after the pass on the real MiniLM, the packed layout of the lifted
weights, numerics of the packed kernel through the real CPU pipeline on odd shapes (symbolic and
static M, fused epilogues), and that the schedule reads the panels without repacking them.

Every test runs for both AVX2 (8 fp32 lanes) and AVX-512 (16 lanes), with shapes derived from the
lane count, so an AVX2 machine checks the AVX-512 layout and schedule too. The targets are the
x86-64 levels v3 and v4 (the features every AVX2 / AVX-512 CPU has, znver3 and znver4 included);
code for a level this CPU does not reach is compiled, never run.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
import tvm_ffi
from conftest import prefetch_guards, prefetched_addresses
from tvm import relax, tirx
from tvm.relax.backend.cpu_generic import pipeline as cpu
from tvm.sym import Analyzer

from artifact.cpu_features import missing_on_host, target_features
from compile.build import make_target
from compile.capabilities import Capabilities
from compile.kernels.dense import packed_panel_width, schedule_matmul
from compile.lowering import tir_pipeline
from compile.opcount import tracked_counts
from compile.passes.lift import lift_and_transform
from compile.passes.packing import pack_linear_weights
from compile.passes.specialize import specialize_te_kernels
from compile.passes.strategy import apply_strategy
from compile.schedule import cpu_pipeline

MCPU_OF_LANES = {8: "x86-64-v3", 16: "x86-64-v4"}  # AVX2 + FMA; AVX-512 F/BW/CD/DQ/VL
TARGETS = {lanes: make_target("cpu", mcpu=mcpu) for lanes, mcpu in MCPU_OF_LANES.items()}
each_lane_count = pytest.mark.parametrize("lanes", sorted(TARGETS))


def _runs_here(target: tvm.target.Target) -> bool:
    """Whether this CPU has every feature code for `target` may use (unknown: assume it has)."""
    return not missing_on_host(target_features(target))


def _panel(lanes: int) -> int:
    """The widest panel `schedule_matmul` cuts for `lanes` (a width every candidate divides)."""
    return packed_panel_width(48 * lanes, lanes)


def _packable(lanes: int) -> int:
    """An N of three panels: 72 with AVX2 (24-wide panels), 144 with AVX-512 (48-wide)."""
    return 3 * _panel(lanes)


def _unpackable(lanes: int) -> int:
    """An N no panel width divides (so N would need padding): 20 with AVX2, 40 with AVX-512."""
    return 2 * lanes + lanes // 2


def _linear_module(m, k: int, n: int) -> tvm.IRModule:
    """gelu(x[m, k] @ W[n, k]^T + b) with W and b weights (parameters after `num_input`)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    w = relax.Var("w", relax.TensorType((n, k), "float32"))
    b = relax.Var("b", relax.TensorType((n,), "float32"))
    with bb.function("main", [x, w, b], attrs={"num_input": 1}):
        with bb.dataflow():
            y = bb.emit(relax.op.add(relax.op.matmul(x, bb.emit(relax.op.permute_dims(w, [1, 0]))), b))
            out = bb.emit_output(bb.emit(relax.op.nn.gelu(y)))
        bb.emit_func_output(out)
    return bb.get()


def _weights(k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(k * n)
    return rng.standard_normal((n, k)).astype("float32"), rng.standard_normal(n).astype("float32")


def _fused(mod: tvm.IRModule, lanes: int) -> tvm.IRModule:
    target = TARGETS[lanes]
    with target:
        return tvm.transform.Sequential(cpu.legalize_passes(target))(mod)


def _fused_packed_kernel(mod: tvm.IRModule, lanes: int) -> tirx.PrimFunc:
    (kernel,) = [f for gv, f in _fused(mod, lanes).functions_items() if "packed_matmul" in gv.name_hint]
    return kernel


def test_targets_have_the_lane_counts_they_stand_for():
    assert {lanes: Capabilities.of(target).lanes for lanes, target in TARGETS.items()} == {8: 8, 16: 16}
    assert _packable(8) == 72 and _packable(16) == 144
    assert _unpackable(8) == 20 and _unpackable(16) == 40


@each_lane_count
def test_panel_widths_derived_from_lanes(lanes):
    assert packed_panel_width(_packable(lanes), lanes) == _panel(lanes)
    assert _packable(lanes) % (2 * lanes) == 0 or _packable(lanes) % (3 * lanes) == 0
    assert packed_panel_width(_unpackable(lanes), lanes) is None


@each_lane_count
def test_minilm_linears_are_packed_and_lifted(minilm_imported, lanes):
    combined = apply_strategy(minilm_imported.mod, "concat")
    packed, count = pack_linear_weights(combined, lanes)
    assert count == 6 * 4  # per layer: the Q/K/V concat, the attention output, FFN in and out
    assert tracked_counts(combined)["matmul"] == 36
    assert tracked_counts(packed)["matmul"] == 12  # the attention batch matmuls stay
    lifted = lift_and_transform(packed, minilm_imported.params)
    panels = [w.shape for w in lifted.weights if w.ndim == 3]
    nt = packed_panel_width(384, lanes)
    assert len(panels) == 24 and all(shape[2] == nt and shape[1] in (384, 1536) for shape in panels)
    assert sorted({shape[0] * nt for shape in panels}) == [384, 1152, 1536]


@each_lane_count
def test_a_width_the_panel_does_not_divide_stays_unpacked(lanes):
    n = _unpackable(lanes)
    assert packed_panel_width(n, lanes) is None
    mod, count = pack_linear_weights(_linear_module(tirx.Var("m", "int64"), 16, n), lanes)
    assert count == 0 and tracked_counts(mod)["matmul"] == 1


@each_lane_count
@pytest.mark.parametrize("m,k", [(1, 48), (7, 48), (37, 48), ("symbolic", 48), (7, 30), (7, 45)])
def test_packed_kernel_matches_torch(m, k, lanes):
    """Packs, lifts and compiles for both lane counts; runs only what this CPU can run. K of 48, 30
    and 45: the k loop unrolled by 4, 2 and not at all (`test_the_k_loop_runs_steps_unrolled`)."""
    n, target = _packable(lanes), TARGETS[lanes]
    w, b = _weights(k, n)
    mod, count = pack_linear_weights(_linear_module(tirx.Var("m", "int64") if m == "symbolic" else m, k, n), lanes)
    assert count == 1
    lifted = lift_and_transform(mod, [tvm.runtime.tensor(w), tvm.runtime.tensor(b)])
    nt = packed_panel_width(n, lanes)
    assert lifted.weights[-1].shape == (n // nt, k, nt)
    np.testing.assert_array_equal(lifted.weights[-1], w.reshape(n // nt, nt, k).transpose(0, 2, 1))
    executable = tvm.compile(lifted.mod, target, relax_pipeline=cpu_pipeline(target), tir_pipeline=tir_pipeline(target))
    if not _runs_here(target):
        pytest.skip(f"compiled for {MCPU_OF_LANES[lanes]}; this CPU lacks its features, so it is not run")
    vm = relax.VirtualMachine(executable, tvm.cpu())
    for rows in ([5, 1, 19] if m == "symbolic" else [m]):
        x = np.random.default_rng(rows).standard_normal((rows, k)).astype("float32")
        out = vm["main"](tvm.runtime.tensor(x), *[tvm.runtime.tensor(p) for p in lifted.weights]).numpy()
        expected = torch.nn.functional.gelu(torch.from_numpy(x) @ torch.from_numpy(w).T + torch.from_numpy(b))
        np.testing.assert_allclose(out, expected.numpy(), rtol=1e-4, atol=1e-4)


@each_lane_count
def test_schedule_reads_the_panels_without_repacking(lanes):
    packed, _ = pack_linear_weights(_linear_module(tirx.Var("m", "int64"), 384, 1536), lanes)
    plain = _linear_module(tirx.Var("m", "int64"), 384, 1536)
    for mod, repacks in ((packed, False), (plain, True)):
        lifted = lift_and_transform(mod, [tvm.runtime.tensor(w) for w in _weights(384, 1536)])
        (kernel,) = [f for gv, f in _fused(lifted.mod, lanes).functions_items() if "matmul" in gv.name_hint]
        sch = schedule_matmul(kernel, lanes)
        names = [sch.get(block).name_hint for block in sch.get_child_blocks(sch.get_sblock("root"))]
        assert any(name.endswith("_global") and name.startswith(("lv", "w")) for name in names) == repacks, names
        assert not any(name.startswith("panel_view") for name in names)  # the panels' view is inlined
        text = sch.mod["main"].script()
        assert "T.parallel" in text and "T.vectorized" in text


@each_lane_count
@pytest.mark.parametrize("m", [16, "symbolic"])
def test_the_kernel_prefetches_the_next_panel_and_accumulates_on_the_stack(m, lanes):
    """Each k step prefetches row k of panel tile + 1 (every 64-byte line of it), and with the CPU
    TIR pipeline no buffer of the kernel is a heap workspace: the accumulator (1 KB with AVX-512,
    TVM's own threshold) stays an alloca LLVM keeps in registers despite the prefetch calls."""
    target, n = TARGETS[lanes], 1536
    packed, _ = pack_linear_weights(_linear_module(tirx.Var("m", "int64") if m == "symbolic" else m, 384, n), lanes)
    lifted = lift_and_transform(packed, [tvm.runtime.tensor(w) for w in _weights(384, n)])
    func = schedule_matmul(_fused_packed_kernel(lifted.mod, lanes), lanes).mod["main"]
    rows = prefetched_addresses(func)  # (panel index, k, column) of every prefetched address
    nt, steps = packed_panel_width(n, lanes), 4  # K = 384: the k loop unrolled by 4
    offsets = []
    for _, k, column in rows:  # k = 4 x the iteration + the step in it
        start, step = (k.a, int(k.b)) if isinstance(k, tirx.Add) else (k, 0)
        assert isinstance(start, tirx.Mul) and int(start.b) == steps
        offsets.append(step * nt + int(column))
    assert sorted(offsets) == list(range(0, steps * nt, 16))  # each cache line of the iteration's 4 rows once
    for panel, _, _ in rows:  # (tile + 1) % panels
        assert isinstance(panel, tirx.FloorMod) and int(panel.b) == n // nt and int(panel.a.b) == 1
    tiles = [loop.extent for loop in prefetch_guards(func)]  # only the first tile of rows prefetches
    mt = 8 if lanes == 16 else 4
    expected = m // mt if m != "symbolic" else (func.params[0].shape[0] + mt - 1) // mt
    assert tiles and all(Analyzer().can_prove_equal(extent, expected) for extent in tiles)
    module = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    lower, finalize_host, _ = tvm.tirx.get_tir_pipeline(tir_pipeline(target))
    host = finalize_host()(lower(tvm.tirx.transform.BindTarget(target.with_host(target))(module))).script()
    assert "TVMBackendAllocWorkspace" not in host


@each_lane_count
@pytest.mark.parametrize("k,steps", [(48, 4), (30, 2), (45, 1), ("symbolic", 1)])
def test_the_k_loop_runs_steps_unrolled(k, steps, lanes):
    """Each iteration of the k loop runs 4 of its steps unrolled, else 2, where they divide K (none where
    K is symbolic): per iteration, the products of `steps` steps and one increment, compare and branch."""
    k_size = tirx.Var("k", "int64") if k == "symbolic" else k
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((16, k_size), "float32"))
    w = relax.Var("w", relax.TensorType((k_size, _packable(lanes)), "float32"))
    with bb.function("main", [x, w]):
        bb.emit_func_output(bb.emit(relax.op.matmul(x, w)))
    (kernel,) = [f for gv, f in _fused(bb.get(), lanes).functions_items() if "matmul" in gv.name_hint]
    func, loops = schedule_matmul(kernel, lanes).mod["main"], []
    tvm_ffi.structural_walk(func, [(tirx.For, loops.append)])
    reduction = [loop for loop in loops if loop.loop_var.name.startswith("k")]
    unrolled = [loop for loop in reduction if loop.kind == tirx.ForKind.UNROLLED]
    assert [int(loop.extent) for loop in unrolled] == ([steps] if steps > 1 else []), reduction
    (outer,) = [loop for loop in reduction if loop.kind == tirx.ForKind.SERIAL]
    assert Analyzer().can_prove_equal(outer.extent * steps, func.params[0].shape[1])  # K


@each_lane_count
def test_bucket_specialisation_rewrites_the_kernel_for_static_shapes(lanes):
    n = _packable(lanes)
    mod, count = pack_linear_weights(_linear_module(tirx.Var("m", "int64"), 48, n), lanes)
    assert count == 1
    m = mod["main"].params[0].ty.shape[0]
    static = specialize_te_kernels(relax.transform.BindSymbolicVars({m: 6})(mod))
    kernel = _fused_packed_kernel(static, lanes)
    text = kernel.script()
    assert "T.Buffer((T.int64(6), T.int64(48))" in text and f"T.int64(6), T.int64({n})" in text
    assert "TypeVar(" not in text  # no symbolic M left (the generic kernel declares m = TypeVar("m"))
    sch = schedule_matmul(kernel, lanes)
    assert sch is not None
    assert f"T.int64({lanes})" in sch.mod["main"].script()  # vectorised by the lane count


@each_lane_count
def test_specialised_kernel_keeps_its_epilogue_fused(lanes):
    """Re-specialising the kernel for a bucket leaves nothing between it and its bias + GELU: FuseOps
    makes one kernel of the three (an alias binding `lv = lv_new` once stopped it, and every linear
    wrote its output, then read it back for the bias and again for GELU)."""
    mod, _ = pack_linear_weights(_linear_module(tirx.Var("m", "int64"), 48, _packable(lanes)), lanes)
    m = mod["main"].params[0].ty.shape[0]
    static = specialize_te_kernels(relax.transform.BindSymbolicVars({m: 6})(mod))
    names = [gv.name_hint for gv, _ in _fused(static, lanes).functions_items() if "packed_matmul" in gv.name_hint]
    assert len(names) == 1 and names[0].startswith("fused_packed_matmul") and names[0].endswith("_add_gelu"), names


@each_lane_count
def test_pipeline_packs_for_the_lane_count_of_its_target(lanes):
    """What a compile does for a CPU target: pack at `Capabilities.of(target).lanes`, then build
    for that target (the AVX-512 build must succeed on an AVX2 machine, where it is not run)."""
    target = TARGETS[lanes]
    n = _packable(Capabilities.of(target).lanes)
    mod, count = pack_linear_weights(_linear_module(tirx.Var("m", "int64"), 48, n), Capabilities.of(target).lanes)
    assert count == 1
    lifted = lift_and_transform(mod, [tvm.runtime.tensor(x) for x in _weights(48, n)])
    assert lifted.weights[-1].shape == (n // _panel(lanes), 48, _panel(lanes))
    tvm.compile(lifted.mod, target, relax_pipeline=cpu_pipeline(target), tir_pipeline=tir_pipeline(target))
