"""SmoothQuant-style per-input-channel scaling of the linears that int8 quantizes.

Per-token int8 activations lose most where a few input channels are far larger than the rest
(BERT's layer-norm outputs have such channels): one token's scale is set by its largest channel,
and every other channel keeps only a few levels. Scaling input channel j of the activation down
by s_j and the weight's input column j up by s_j leaves the product exact,

    y = x @ W^T = (x / s) @ (W * s)^T,   s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

(Xiao et al., SmoothQuant, 2023), and moves part of the activation's range into the weights,
which are quantized per output channel and take it better. max|X_j| comes from the calibration
sentences (compile/int8_plan.py chooses alpha by measurement).

The pass rewrites `matmul(x, permute_dims(W))` into `matmul(x * (1 / s), permute_dims(W * s))`.
`W * s` is weight-only, so LiftTransformParams folds it into the shipped weights at compile time;
`x * (1 / s)` is one multiply per element that the int8 pass (passes/quantize.py) folds into the
per-token quantizer, which reads every element of x anyway (kernels/row_quantize.py). (BERT's layer
norms also feed the residual add, so folding 1 / s into their gamma and beta would change the
residual stream: the multiply stays at the quantizer.)
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from . import as_pass
from .linears import bindings, rewrite_linears
from .packing import linears_on_weights

PARAM_PREFIX = "p_"  # torch.export's name for a parameter: p_ + its module path with "_" for "."
OUTPUT_PROJECTION, VALUE_PROJECTION = "attention_output_dense", "attention_self_value"  # BERT's module names


def smoothing_scales(activation_max: np.ndarray, weight_max: np.ndarray, alpha: float) -> np.ndarray:
    """s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), per input channel j (channels that never
    fire, or have no weight, keep s = 1)."""
    activation_max = np.asarray(activation_max, dtype=np.float64)
    weight_max = np.asarray(weight_max, dtype=np.float64)
    live = (activation_max > 0) & (weight_max > 0)
    scales = np.ones_like(activation_max)
    scales[live] = activation_max[live] ** alpha / weight_max[live] ** (1.0 - alpha)
    return scales.astype(np.float32)


def module_key(module_name: str) -> str:
    """A torch Linear's name as its weight's Relax parameter spells it (lower case, "_" for ".")."""
    return module_name.replace(".", "_").lower()


def linear_modules(func: relax.Function, linears: dict[relax.Var, relax.Expr]) -> dict[relax.Var, list[str]]:
    """{matmul var: the `module_key`s of the torch Linears whose weights it multiplies} (one, or
    Q, K and V for a concatenated projection), from the weight parameters' names."""
    num_input = int(func.attrs["num_input"]) if "num_input" in func.attrs else 0
    params = set(func.params[num_input:])
    value = bindings(func)

    def weight_params(expr: relax.Expr) -> list[str]:
        names = []
        for var in relax.analysis.free_vars(expr):
            if var in params:
                names.append(var.name)
            elif var in value:
                names.extend(weight_params(value[var]))
        return names

    found = {}
    for var, weight in linears.items():
        names = sorted(n[len(PARAM_PREFIX):-len("_weight")] for n in weight_params(weight)
                       if n.startswith(PARAM_PREFIX) and n.endswith("_weight"))
        if names:
            found[var] = names
    return found


def smooth_linears(mod: tvm.IRModule, scales: dict[str, np.ndarray]) -> tuple[tvm.IRModule, int]:
    """`mod` with each of `main`'s linears whose torch Linear (its `module_key`) has a scale
    vector in `scales` smoothed, and how many were rewritten. Run before quantize_linears. A linear no
    longer there as a matmul (on a sparse kernel: passes/sparsity.py) keeps its weights and its input."""
    present = {key for keys in linear_modules(mod["main"], linears_on_weights(mod["main"])).values() for key in keys}
    scales = {key: s for key, s in scales.items() if key in present}
    folded = _fold_into_values(mod["main"], scales)
    if folded:
        mod = _ScaleParams(mod, folded).transform()
    linears = linears_on_weights(mod["main"])
    modules = linear_modules(mod["main"], linears)
    chosen = {}
    for var, keys in modules.items():
        found = {tuple(scales[k].tolist()) for k in keys if k in scales}
        if len(found) == 1 and all(k in scales for k in keys):  # a concatenation shares its input's s
            chosen[var] = np.asarray(scales[keys[0]], dtype=np.float32)
    scale_of = {linears[var]: s for var, s in chosen.items()}  # the rewrite sees the (unchanged) weight
    folded_weights = {linears[var] for var in chosen if modules[var][0] in folded}

    def smooth(builder: relax.BlockBuilder, x: relax.Expr, w: relax.Expr, n: int, k: int) -> relax.Expr | None:
        s = scale_of[w]
        if w not in folded_weights:  # else x arrives scaled: 1 / s is folded into the V projection
            x = builder.emit(relax.op.multiply(x, relax.const((1.0 / s).astype(np.float32))))
        smoothed_w = builder.emit(relax.op.multiply(w, relax.const(s)))
        return builder.emit(relax.op.matmul(x, relax.op.permute_dims(smoothed_w)))

    return rewrite_linears(mod, {var: linears[var] for var in chosen}, smooth)


def value_projection(key: str) -> str | None:
    """The `module_key` of the V projection whose output channels an attention output projection's
    (`key`) smoothing is folded into (`_fold_into_values`), or None for any other linear."""
    return key[:-len(OUTPUT_PROJECTION)] + VALUE_PROJECTION if key.endswith(OUTPUT_PROJECTION) else None


def _fold_into_values(func: relax.Function, scales: dict[str, np.ndarray]) -> dict[str, dict[relax.Var, np.ndarray]]:
    """{attention output projection's module key: {V weight param: 1 / s per row, V bias: 1 / s}}
    for each smoothed output projection whose layer's V projection is found by BERT's names
    (`attention.output.dense` reads `attention.self.value`'s channels through attention, which is
    linear in V: scaling V's output channel j by 1 / s_j scales the context's channel j by it)."""
    params = {p.name: p for p in func.params}
    found = {}
    for key, s in scales.items():
        value = value_projection(key)
        if value is None:
            continue
        weight, bias = params.get(PARAM_PREFIX + value + "_weight"), params.get(PARAM_PREFIX + value + "_bias")
        if weight is None or bias is None or [int(d) for d in weight.ty.shape][0] != len(s):
            continue
        inverse = (1.0 / s).astype(np.float32)
        found[key] = {weight: inverse[:, None], bias: inverse}
    return found


@relax.expr_functor.mutator
class _ScaleParams(relax.PyExprMutator):
    """Every use of a parameter in `scales` becomes `param * scale` (weight-only: lifted)."""

    def __init__(self, mod: tvm.IRModule, folded: dict[str, dict[relax.Var, np.ndarray]]):
        super().__init__(mod)
        self.module = mod
        self.scales = {param: scale for per_key in folded.values() for param, scale in per_key.items()}

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        if var in self.scales:
            return self.builder_.emit(relax.op.multiply(var, relax.const(self.scales[var])))
        return super().visit_var_(var)

    def transform(self) -> tvm.IRModule:
        self.builder_.update_func(self.module.get_global_var("main"), self.visit_expr(self.module["main"]))
        return self.builder_.get()


def SmoothLinears(scales: dict[str, np.ndarray]) -> tvm.transform.Pass:
    """`smooth_linears` as a pass."""
    return as_pass("SmoothLinears", lambda mod: smooth_linears(mod, scales)[0])
