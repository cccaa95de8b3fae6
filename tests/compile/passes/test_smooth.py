"""compile/passes/smooth.py: SmoothQuant's scaling: SmoothLinears as Before/Expected, exact in fp32, its
weight side folded into the weights, on hand-written IR and on a tiny BERT."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import relax as R

from compile.checkpoint import example_inputs
from compile.importer import export_and_import
from compile.opcount import count_ops
from compile.passes.lift import lift_and_transform
from compile.passes.smooth import SmoothLinears, linear_modules, smooth_linears, smoothing_scales
from compile.passes.strategy import apply_strategy
from tests.support.relax_modules import linear_module
from tests.support.tvm_run import build_reference, run

pytestmark = pytest.mark.slow  # collected first: see conftest.py


@tvm.script.ir_module
class TwoLinears:
    """Layer norm -> linear -> GELU -> linear, weights named as torch.export names them."""

    @R.function
    def main(x: R.Tensor((6, 16), "float32"), p_ln_weight: R.Tensor((16,), "float32"),
             p_ln_bias: R.Tensor((16,), "float32"), p_up_weight: R.Tensor((32, 16), "float32"),
             p_up_bias: R.Tensor((32,), "float32"), p_down_weight: R.Tensor((16, 32), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            h = R.nn.layer_norm(x, p_ln_weight, p_ln_bias, axes=[-1])
            up = R.add(R.matmul(h, R.permute_dims(p_up_weight)), p_up_bias)
            down = R.matmul(R.nn.gelu(up), R.permute_dims(p_down_weight))
            R.output(down)
        return down


def test_smoothing_is_exact_in_fp32_and_its_weight_side_is_folded():
    rng = np.random.default_rng(0)
    args = [rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32") for p in TwoLinears["main"].params]
    args[0][:, 3] *= 40.0  # an outlier channel, as BERT's layer norms have
    scales = {"up": rng.uniform(0.1, 10.0, 16).astype("float32"), "down": rng.uniform(0.1, 10.0, 32).astype("float32")}
    smoothed, rewritten = smooth_linears(TwoLinears, scales)
    assert rewritten == 2
    assert count_ops(smoothed).get("relax.multiply", 0) == count_ops(TwoLinears).get("relax.multiply", 0) + 4
    np.testing.assert_allclose(run(build_reference(smoothed), *args), run(build_reference(TwoLinears), *args), rtol=2e-5, atol=2e-5)
    # W * s is weight-only: lifted out of main, only the two activation multiplies run per call
    lifted = lift_and_transform(smoothed, [tvm.runtime.tensor(a) for a in args[1:]])
    assert count_ops(lifted.mod)["relax.multiply"] == count_ops(TwoLinears).get("relax.multiply", 0) + 2


def test_smoothing_leaves_linears_without_a_scale_alone():
    smoothed, rewritten = smooth_linears(TwoLinears, {"up": np.ones(16, "float32")})
    assert rewritten == 1
    assert count_ops(smoothed)["relax.multiply"] == count_ops(TwoLinears).get("relax.multiply", 0) + 2


def test_smoothing_a_bert_is_exact_in_fp32_and_folds_the_output_projections_into_v(tiny_bert_dir):
    """Every linear smoothed with random scales (Q, K and V sharing theirs): the model's outputs
    stay fp32's; the attention output projection's 1 / s is folded into V's weights (attention is
    linear in V), so only the other three linears of a layer multiply their input per call."""
    from compile.checkpoint import example_inputs, inspect_checkpoint, load_wrapper
    from compile.importer import export_and_import
    from compile.passes.packing import linears_on_weights
    from compile.passes.strategy import apply_strategy

    info = inspect_checkpoint(tiny_bert_dir, "embed")
    imported = export_and_import(load_wrapper(info, "embed"), 4, info.max_seq, info.config["vocab_size"])
    mod = apply_strategy(imported.mod, "concat")
    rng = np.random.default_rng(1)
    scales = {}
    for keys in linear_modules(mod["main"], linears_on_weights(mod["main"])).values():
        width = int(next(p for p in mod["main"].params if p.name == f"p_{keys[0]}_weight").ty.shape[1])
        scales.update(dict.fromkeys(keys, rng.uniform(0.2, 5.0, width).astype("float32")))
    smoothed, rewritten = smooth_linears(mod, scales)
    assert rewritten == 2 * 4
    inputs = [x.numpy() for x in example_inputs(3, 9, info.config["vocab_size"])]
    outputs, multiplies = [], []
    for module in (mod, smoothed):
        lifted = lift_and_transform(module, imported.params)
        outputs.append(run(build_reference(lifted.mod), *inputs, *lifted.weights))
        multiplies.append(count_ops(lifted.mod).get("relax.multiply", 0))
    assert multiplies[1] == multiplies[0] + 2 * 3  # per layer: Q/K/V, FFN in, FFN out
    for smoothed_output, output in zip(outputs[1], outputs[0], strict=True):  # pooled, then every token's state
        np.testing.assert_allclose(smoothed_output, output, rtol=1e-4, atol=1e-5)


def test_an_output_projection_on_a_sparse_kernel_keeps_v_unscaled(tiny_bert_dir):
    """Sparse kernels first (compile/passes/sparsity.py), then smoothing with a scale for every linear: the
    attention output projections are no longer matmuls, so their 1 / s is not folded into V (which would
    scale the context with nothing to undo it) and the model stays fp32's."""
    from compile.build import make_target
    from compile.checkpoint import inspect_checkpoint, load_wrapper
    from compile.passes.packing import linears_on_weights
    from compile.passes.sparsity import prune_model, sparsify
    from compile.sparse_choice import SparseChoice

    info = inspect_checkpoint(tiny_bert_dir, "embed")
    wrapper = load_wrapper(info, "embed")
    prune_model(wrapper.bert, 0.25, (16, 1), ("attention_output",))
    imported = export_and_import(wrapper, 4, info.max_seq, info.config["vocab_size"])
    combined = apply_strategy(imported.mod, "concat")
    rng = np.random.default_rng(1)
    scales = {}
    for keys in linear_modules(combined["main"], linears_on_weights(combined["main"])).values():
        width = int(next(p for p in combined["main"].params if p.name == f"p_{keys[0]}_weight").ty.shape[1])
        scales.update(dict.fromkeys(keys, rng.uniform(0.2, 5.0, width).astype("float32")))
    mod, params, report = sparsify(combined, imported.params, SparseChoice((16, 1), 0.5, make_target("cpu")))
    assert report["rewritten"] == 2  # the attention output projection of both layers
    smoothed, rewritten = smooth_linears(mod, scales)
    assert rewritten == 2 * 3  # Q/K/V, FFN in, FFN out
    inputs = [x.numpy() for x in example_inputs(3, 9, info.config["vocab_size"])]
    outputs = []
    for module in (mod, smoothed):
        lifted = lift_and_transform(module, params)
        outputs.append(run(build_reference(lifted.mod), *inputs, *lifted.weights))
    for smoothed_output, output in zip(outputs[1], outputs[0], strict=True):  # pooled, then every token's state
        np.testing.assert_allclose(smoothed_output, output, rtol=1e-4, atol=1e-5)


def test_smoothing_scales_follow_smoothquant():
    activation, weight = np.array([8.0, 1.0, 0.0]), np.array([2.0, 4.0, 1.0])
    np.testing.assert_allclose(smoothing_scales(activation, weight, 0.5), [2.0, 0.5, 1.0])  # dead channel: 1
    np.testing.assert_allclose(smoothing_scales(activation, weight, 0.0), [0.5, 0.25, 1.0])


def test_concatenated_qkv_is_one_linear_of_three_modules(tiny_bert_dir):
    from compile.checkpoint import inspect_checkpoint, load_wrapper
    from compile.importer import export_and_import
    from compile.passes.packing import linears_on_weights
    from compile.passes.strategy import apply_strategy

    info = inspect_checkpoint(tiny_bert_dir, "embed")
    imported = export_and_import(load_wrapper(info, "embed"), 4, info.max_seq, info.config["vocab_size"])
    mod = apply_strategy(imported.mod, "concat")
    modules = sorted(linear_modules(mod["main"], linears_on_weights(mod["main"])).values())
    assert len(modules) == 2 * 4
    assert ["bert_encoder_layer_0_attention_self_key", "bert_encoder_layer_0_attention_self_query",
            "bert_encoder_layer_0_attention_self_value"] in modules


def test_a_linear_with_a_scale_is_smoothed():
    k, n = 8, 4
    s = np.linspace(0.5, 4.0, k).astype("float32")
    builder = relax.BlockBuilder()
    x, w = relax.Var("x", R.Tensor((6, k), "float32")), relax.Var("p_up_weight", R.Tensor((n, k), "float32"))
    with builder.function("main", [x, w], attrs={"num_input": 1}):
        with builder.dataflow():
            scaled_x = builder.emit(relax.op.multiply(x, relax.const((1.0 / s).astype("float32"))))
            scaled_w = builder.emit(relax.op.multiply(w, relax.const(s)))
            y = builder.emit_output(builder.emit(relax.op.matmul(scaled_x, relax.op.permute_dims(scaled_w))))
        builder.emit_func_output(y)
    smoothed = SmoothLinears({"up": s})(linear_module(k, n, weight="p_up_weight"))
    tvm.ir.assert_structural_equal(smoothed, builder.get())


def test_a_linear_without_a_scale_is_left_alone():
    before = linear_module(8, 4, weight="p_up_weight")
    tvm.ir.assert_structural_equal(SmoothLinears({"down": np.ones(8, "float32")})(before), before)
