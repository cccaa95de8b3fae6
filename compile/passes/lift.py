"""Lifting weight-only computation (concat, permute) out of `main`, run once at compile time.

After LiftTransformParams, `main` takes the transformed weights; `main_transform_params`
maps the checkpoint's weights to them. We run it once here and ship its outputs, so every
bucket library and the generic one share one weight file and nothing is re-done per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

TRANSFORM_FUNC = "main_transform_params"


@dataclass
class LiftedModel:
    mod: tvm.IRModule  # `main` (taking the transformed weights after its inputs) and its PrimFuncs
    weight_names: list[str]
    weights: list[np.ndarray]


def lift_and_transform(mod: tvm.IRModule, params: list[tvm.runtime.Tensor]) -> LiftedModel:
    """LiftTransformParams, then `transform_weights`."""
    return transform_weights(relax.transform.LiftTransformParams()(mod), params)


def transform_weights(lifted: tvm.IRModule, params: list[tvm.runtime.Tensor]) -> LiftedModel:
    """Run a lifted module's `main_transform_params` on the checkpoint's weights, once, here."""
    main = lifted["main"]
    # the transform and the kernels it calls (e.g. the bf16 rounding of weights)
    transform = relax.transform.DeadCodeElimination([TRANSFORM_FUNC])(
        tvm.IRModule({gvar: func for gvar, func in lifted.functions_items() if gvar.name_hint != "main"}))
    target = tvm.target.Target({"kind": "llvm"})
    executable = tvm.compile(transform, target, relax_pipeline=relax.get_default_pipeline(target))
    device = tvm.cpu()
    vm = relax.VirtualMachine(executable, device)
    outputs = vm[TRANSFORM_FUNC]([tvm.runtime.tensor(p.numpy(), device) for p in params])
    weights = [np.ascontiguousarray(outputs[i].numpy()) for i in range(len(outputs))]
    num_input = int(main.attrs["num_input"])
    weight_names = [param.name for param in main.params[num_input:]]
    if len(weight_names) != len(weights):
        raise RuntimeError(f"lifted main takes {len(weight_names)} weights but transform made {len(weights)}")
    # Keep pre-scheduled kernels `main` calls (e.g. sparse matmuls); drop only the transform.
    kept = {gvar: func for gvar, func in lifted.functions_items() if gvar.name_hint != TRANSFORM_FUNC}
    return LiftedModel(mod=tvm.IRModule(kept), weight_names=weight_names, weights=weights)
