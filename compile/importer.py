"""torch.export with dynamic batch and sequence, then import into TVM Relax."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import tvm
from tvm import relax

from .checkpoint import INPUT_NAMES, example_inputs


@dataclass
class ImportedModel:
    """The Relax module (weights still function parameters) and the weights in order."""

    mod: tvm.IRModule
    params: list[tvm.runtime.Tensor]


def export_and_import(wrapper: torch.nn.Module, max_batch: int, max_seq: int, vocab_size: int) -> ImportedModel:
    """Export with symbolic (batch, seq) and import, keeping weights as parameters.

    Weights stay parameters (not constants) because CombineParallelMatmul only matches
    Vars, and LiftTransformParams later moves weight-only work out of `main`.
    """
    from torch.export import Dim
    from tvm.relax.frontend.torch import from_exported_program

    # Export at batch 2 x seq 8: an example of 1 would specialise the dimension to 1, and one
    # equal to its upper bound breaks the import, so the bounds are at least one above it.
    # (The loader enforces the configured max_batch; this is only the graph's upper bound.)
    batch = Dim("batch", min=1, max=max(max_batch, 3))
    seq = Dim("seq", min=1, max=max(max_seq, 9))
    dynamic_shapes = {name: {0: batch, 1: seq} for name in INPUT_NAMES}
    args = example_inputs(2, 8, vocab_size)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(wrapper, args, dynamic_shapes=dynamic_shapes)
        mod = from_exported_program(program, keep_params_as_input=True)
    mod, params = relax.frontend.detach_params(mod)
    return ImportedModel(mod=mod, params=list(params["main"]))


def symbolic_dims(mod: tvm.IRModule) -> tuple[tvm.tirx.Var, tvm.tirx.Var]:
    """The (batch, seq) symbolic variables of `main`'s first input."""
    shape = mod["main"].params[0].ty.shape
    return shape[0], shape[1]
