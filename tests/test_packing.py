"""compile/packing.py: linear weights packed at load into the CPU kernel's panels.

Counts of ops before and after the pass on the real MiniLM, the packed layout of the lifted
weights, numerics of the packed kernel through the real CPU pipeline on odd shapes (symbolic and
static M, fused epilogues), and that the schedule reads the panels without repacking them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax, tirx
from tvm.relax.backend.cpu_generic import pipeline as cpu

from compile.build import make_target
from compile.cpu_schedule import cpu_pipeline, packed_panel_width, schedule_matmul, vector_lanes
from compile.lift import lift_and_transform
from compile.opcount import tracked_counts
from compile.packing import pack_linear_weights, specialize_packed_matmuls
from compile.strategy import apply_strategy

TARGET = make_target("cpu")
LANES = vector_lanes(TARGET)


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


def _fused_packed_kernel(mod: tvm.IRModule) -> tirx.PrimFunc:
    with TARGET:
        fused = tvm.transform.Sequential(cpu.legalize_passes(TARGET))(mod)
    (kernel,) = [f for gv, f in fused.functions_items() if "packed_matmul" in gv.name_hint]
    return kernel


def test_minilm_linears_are_packed_and_lifted(minilm_imported):
    combined = apply_strategy(minilm_imported.mod, "concat")
    packed, count = pack_linear_weights(combined, LANES)
    assert count == 6 * 4  # per layer: the Q/K/V concat, the attention output, FFN in and out
    assert tracked_counts(combined)["matmul"] == 36
    assert tracked_counts(packed)["matmul"] == 12  # the attention batch matmuls stay
    lifted = lift_and_transform(packed, minilm_imported.params)
    panels = [w.shape for w in lifted.weights if w.ndim == 3]
    nt = packed_panel_width(384, LANES)
    assert len(panels) == 24 and all(shape[2] == nt and shape[1] in (384, 1536) for shape in panels)
    assert sorted({shape[0] * nt for shape in panels}) == [384, 1152, 1536]


def test_a_width_the_panel_does_not_divide_stays_unpacked():
    assert packed_panel_width(20, 8) is None
    mod, count = pack_linear_weights(_linear_module(tirx.Var("m", "int64"), 16, 20), 8)
    assert count == 0 and tracked_counts(mod)["matmul"] == 1


@pytest.mark.parametrize("m", [1, 7, 37, "symbolic"])
def test_packed_kernel_matches_torch(m):
    k, n = 48, 72
    w, b = _weights(k, n)
    mod, count = pack_linear_weights(_linear_module(tirx.Var("m", "int64") if m == "symbolic" else m, k, n), LANES)
    assert count == 1
    lifted = lift_and_transform(mod, [tvm.runtime.tensor(w), tvm.runtime.tensor(b)])
    nt = packed_panel_width(n, LANES)
    np.testing.assert_array_equal(lifted.weights[-1], w.reshape(n // nt, nt, k).transpose(0, 2, 1))
    vm = relax.VirtualMachine(tvm.compile(lifted.mod, TARGET, relax_pipeline=cpu_pipeline(TARGET)), tvm.cpu())
    for rows in ([5, 1, 19] if m == "symbolic" else [m]):
        x = np.random.default_rng(rows).standard_normal((rows, k)).astype("float32")
        out = vm["main"](tvm.runtime.tensor(x), *[tvm.runtime.tensor(p) for p in lifted.weights]).numpy()
        expected = torch.nn.functional.gelu(torch.from_numpy(x) @ torch.from_numpy(w).T + torch.from_numpy(b))
        np.testing.assert_allclose(out, expected.numpy(), rtol=1e-4, atol=1e-4)


def test_schedule_reads_the_panels_without_repacking():
    packed, _ = pack_linear_weights(_linear_module(tirx.Var("m", "int64"), 384, 1536), LANES)
    plain = _linear_module(tirx.Var("m", "int64"), 384, 1536)
    for mod, repacks in ((packed, False), (plain, True)):
        lifted = lift_and_transform(mod, [tvm.runtime.tensor(w) for w in _weights(384, 1536)])
        with TARGET:
            fused = tvm.transform.Sequential(cpu.legalize_passes(TARGET))(lifted.mod)
        (kernel,) = [f for gv, f in fused.functions_items() if "matmul" in gv.name_hint]
        sch = schedule_matmul(kernel, LANES)
        names = [sch.get(block).name_hint for block in sch.get_child_blocks(sch.get_sblock("root"))]
        assert any(name.endswith("_global") and name.startswith(("lv", "w")) for name in names) == repacks, names
        assert not any(name.startswith("panel_view") for name in names)  # the panels' view is inlined
        text = sch.mod["main"].script()
        assert "T.parallel" in text and "T.vectorized" in text


def test_bucket_specialisation_rewrites_the_kernel_for_static_shapes():
    mod, _ = pack_linear_weights(_linear_module(tirx.Var("m", "int64"), 48, 72), LANES)
    m = mod["main"].params[0].ty.shape[0]
    static = specialize_packed_matmuls(relax.transform.BindSymbolicVars({m: 6})(mod))
    kernel = _fused_packed_kernel(static)
    text = kernel.script()
    assert "T.Buffer((T.int64(6), T.int64(48))" in text and "T.int64(6), T.int64(72)" in text
    assert "TypeVar(" not in text  # no symbolic M left (the generic kernel declares m = TypeVar("m"))
    assert schedule_matmul(kernel, LANES) is not None
