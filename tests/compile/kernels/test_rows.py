"""compile/kernels/rows.py: layer norm, masked softmax and mean-pool rows, one parallel loop with reductions in
vector lanes, against PyTorch at rtol = atol = 1e-4; a width the lanes do not divide is left to dlight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tvm import relax, tirx

from compile.capabilities import Capabilities
from compile.kernels.rows import schedule_rows
from tests.support.relax_modules import layer_norm_module
from tests.support.schedules import cpu_target, fused, prim_funcs, random_floats
from tests.support.tvm_run import build_scheduled, run

TOL = dict(rtol=1e-4, atol=1e-4)
TARGET = cpu_target()


def test_norm_softmax_meanpool_symbolic():
    """The non-matmul kernels of a BERT: layer norm, masked softmax, masked mean-pool."""
    b, s = tirx.Var("b", "int64"), tirx.Var("s", "int64")
    bb = relax.BlockBuilder()
    h = relax.Var("h", relax.TensorType((b, s, 64), "float32"))
    mask = relax.Var("mask", relax.TensorType((b, s), "float32"))
    gamma, beta = relax.Var("g", relax.TensorType((64,), "float32")), relax.Var("be", relax.TensorType((64,), "float32"))
    with bb.function("main", [h, mask, gamma, beta]):
        with bb.dataflow():
            ln = bb.emit(relax.op.nn.layer_norm(h, gamma, beta, axes=[-1], epsilon=1e-12))
            sm = bb.emit(relax.op.nn.softmax(relax.op.add(ln, relax.op.expand_dims(mask, [2])), axis=1))
            m3 = relax.op.expand_dims(mask, [2])
            pooled = relax.op.divide(relax.op.sum(relax.op.multiply(ln, m3), axis=[1]), relax.op.sum(m3, axis=[1]))
            out = bb.emit_output(relax.Tuple([ln, sm, bb.emit(pooled)]))
        bb.emit_func_output(out)
    built = build_scheduled(bb.get(), TARGET)
    g, be = random_floats(64), random_floats(64, 1)[:, 0]
    for shape in [(1, 1), (3, 17)]:
        x = random_floats(*shape, 64)
        msk = np.ones(shape, "float32")
        msk[1:, shape[1] // 2 :] = 0
        ln, sm, pooled = run(built, x, msk, g, be)
        t = torch.from_numpy(x)
        ref_ln = torch.nn.functional.layer_norm(t, (64,), torch.from_numpy(g), torch.from_numpy(be), 1e-12)
        ref_sm = torch.softmax(ref_ln + torch.from_numpy(msk)[:, :, None], dim=1)
        m3 = torch.from_numpy(msk)[:, :, None]
        np.testing.assert_allclose(ln, ref_ln.numpy(), **TOL)
        np.testing.assert_allclose(sm, ref_sm.numpy(), **TOL)
        np.testing.assert_allclose(pooled, ((ref_ln * m3).sum(1) / m3.sum(1)).numpy(), **TOL)


def test_layer_norm_is_one_parallel_loop_with_vectorised_reductions():
    """Each row's mean and variance reduced in vector lanes, all under one parallel loop over rows
    (dlight's rule launched the pool once per block and summed each row in a scalar chain)."""
    module = layer_norm_module(tirx.Var("t", "int64"), 384)
    (norm,) = prim_funcs(fused(module, TARGET)).values()
    scheduled = schedule_rows(norm, Capabilities.of(TARGET).lanes).mod.script()
    assert scheduled.count("T.parallel") == 1 and scheduled.count("_rf") >= 2 and "T.vectorized" in scheduled
    xs, g, be = random_floats(7, 384) * 3 + 1, random_floats(384), random_floats(384, 1)[:, 0]
    expected = torch.nn.functional.layer_norm(torch.from_numpy(xs), (384,), torch.from_numpy(g), torch.from_numpy(be), 1e-12)
    np.testing.assert_allclose(run(build_scheduled(module, TARGET), xs, g, be), expected.numpy(), **TOL)


@pytest.mark.parametrize("lane_multiple", [2, 5])
def test_attention_softmax_rows_get_the_vectorised_rule(lane_multiple):
    """Attention's scaled, masked softmax over a sequence bound (where attention is left unfused):
    one fused kernel, one parallel loop over rows, max and sum reduced in vector lanes (`rfactor`),
    equal to PyTorch; symbolic batch. The bound is a multiple of this CPU's lanes (16 and 40 with
    AVX2, 32 and 80 with AVX-512)."""

    seq = lane_multiple * Capabilities.of(TARGET).lanes
    b = tirx.Var("b", "int64")
    bb = relax.BlockBuilder()
    scores = relax.Var("scores", relax.TensorType((b, 4, seq, seq), "float32"))
    mask = relax.Var("mask", relax.TensorType((b, 1, 1, seq), "float32"))
    with bb.function("main", [scores, mask]):
        with bb.dataflow():
            scaled = relax.op.add(relax.op.divide(scores, relax.const(8.0, "float32")), mask)
            out = bb.emit_output(bb.emit(relax.op.nn.softmax(scaled, axis=-1)))
        bb.emit_func_output(out)
    kernels = prim_funcs(fused(bb.get(), TARGET))
    softmax = next(f for name, f in kernels.items() if "softmax" in name)
    scheduled = schedule_rows(softmax, Capabilities.of(TARGET).lanes)
    assert scheduled is not None and "_rf" in scheduled.mod.script()  # the partial reductions
    assert scheduled.mod.script().count("T.parallel") == 1  # one launch of the thread pool
    x, msk = random_floats(3, 4, seq, seq) * 4, np.zeros((3, 1, 1, seq), "float32")
    msk[1, ..., seq // 2:] = -1e9
    expected = torch.softmax(torch.from_numpy(x) / 8.0 + torch.from_numpy(msk), dim=-1).numpy()
    np.testing.assert_allclose(run(build_scheduled(bb.get(), TARGET), x, msk), expected, **TOL)


def test_row_rule_leaves_a_width_the_lanes_do_not_divide_to_dlight():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 12), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.softmax(x, axis=-1)))
        bb.emit_func_output(out)
    softmax = next(iter(prim_funcs(fused(bb.get(), TARGET)).values()))
    assert schedule_rows(softmax, 8) is None
