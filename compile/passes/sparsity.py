"""Block sparsity for BERT's linear layers: magnitude block pruning and the rewrite of sparse-enough linears
onto block-sparse kernels.

Relax 0.27 has no sparse-dense op (Relay's `bsr_dense` is gone), so this module brings back what
TVM PR #5377 did for BERT: prune each chosen weight to a block density (or take the checkpoint's own zero
blocks) and compute `y = x @ W^T` with a kernel that reads only the kept blocks. Sparsity is a property of
each linear beside its precision: `SparseChoice` (compile/sparse_choice.py) decides per weight between the
dense kernel of its precision and the block-sparse storages of compile/kernels/bsr.py (the C kernels; the
TIR kernel of compile/kernels/sparse.py where the block does not fit the CPU's vectors, and on CUDA). The
kernels read W's blocks in their own layout, so the `permute_dims` of the dense path disappears, and a
linear left dense goes on to the precision's passes (smoothing, int8, bf16, packing) as before.

Order in the compile stage: `prune_model` on the torch model before export (PyTorch and TVM then
see the same weights), import, `apply_strategy`, `sparsify` (weights must still be parameters of
`main`), the precision's passes, then `LiftTransformParams`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import tvm
from tvm import relax, tirx
from tvm.target import Target

from ..capabilities import Capabilities
from ..kernels import bsr, sparse
from ..kernels.bsr import blocks_of, to_bsr
from ..sparse_choice import DENSE, TIMED_ROWS, SparseChoice, storage_of
from . import as_pass
from .linears import bindings, transposed_linears

LAYERS = {  # module name suffixes: BERT, RoBERTa and XLM-R's, then DistilBERT's
    "ffn": ("intermediate.dense", "output.dense", "ffn.lin1", "ffn.lin2"),
    "attention_output": ("attention.output.dense", "attention.out_lin"),
    "qkv": ("attention.self.query", "attention.self.key", "attention.self.value",
            "attention.q_lin", "attention.k_lin", "attention.v_lin"),
}
DEFAULT_LAYERS = ("ffn", "attention_output")



# ----------------------------------------------------------------------------- pruning and BSR


def block_density(weight: np.ndarray, block: tuple[int, int]) -> float:
    """Fraction of `block`-shaped blocks of `weight` holding any non-zero value."""
    return float(np.any(blocks_of(weight, block) != 0, axis=(2, 3)).mean())


def prune_blocks(weight: np.ndarray, density: float, block: tuple[int, int]) -> np.ndarray:
    """A copy of `weight` [N, K] keeping only the round(density * blocks) blocks of largest L2 norm.

    At least one block is kept so the BSR form never has zero-sized buffers.
    """
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    blocks = blocks_of(weight, block)
    norms = np.sqrt(np.square(blocks.astype(np.float64)).sum(axis=(2, 3))).ravel()
    keep = max(1, round(density * norms.size))
    mask = np.zeros(norms.size, dtype=bool)
    mask[np.argsort(-norms, kind="stable")[:keep]] = True
    pruned = blocks * mask.reshape(blocks.shape[:2])[:, :, None, None]
    return np.ascontiguousarray(pruned.transpose(0, 2, 1, 3).reshape(weight.shape))


def prune_model(model: torch.nn.Module, density: float, block: tuple[int, int],
                layers: tuple[str, ...] = DEFAULT_LAYERS) -> int:
    """Prune in place the Linear weights of `layers` (keys of LAYERS); returns how many were pruned."""
    unknown = set(layers) - set(LAYERS)
    if unknown:
        raise ValueError(f"unknown layer kinds {sorted(unknown)}; choose from {sorted(LAYERS)}")
    suffixes = tuple(suffix for kind in layers for suffix in LAYERS[kind])
    pruned = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.endswith(suffixes) and ".layer." in f".{name}":
                weight = module.weight.detach().cpu().numpy()
                module.weight.copy_(torch.from_numpy(prune_blocks(weight, density, block)))
                pruned += 1
    return pruned


# ----------------------------------------------------------------------------- the kernel


def bsr_matmul_func(k: int, nnz: int, block: tuple[int, int], block_rows: int, dtype: str,
                    target: Target) -> tirx.PrimFunc:
    """The kernel for one weight shape (compile/kernels/sparse.py), generic in M, for `target`."""
    m = tirx.Var("m", "int64")
    if target.kind.name == "cuda":
        return sparse.bsr_matmul_gpu(m, k, nnz, block, block_rows, dtype)
    return sparse.bsr_matmul_cpu(m, k, nnz, block, block_rows, dtype, Capabilities.of(target).lanes)


# ----------------------------------------------------------------------------- the Relax rewrite


def _eligible_linears(func: relax.Function, weights: dict[relax.Var, np.ndarray],
                      block: tuple[int, int]) -> dict[relax.Var, tuple[relax.Var, relax.Var]]:
    """{matmul var: (permute var, W)} for `matmul(x [M, K], permute_dims(W))` with W a weight used only there.

    A weight used anywhere else (tied, concatenated) must keep its dense parameter, so it is skipped.
    """
    value = bindings(func)
    uses: dict[relax.Var, int] = {}

    def count(expr):
        if isinstance(expr, relax.Var):
            uses[expr] = uses.get(expr, 0) + 1

    for expr in [*value.values(), func.body.body]:
        relax.analysis.post_order_visit(expr, count)
    found = {}
    for var, lhs, rhs, weight in transposed_linears(value):
        if weight not in weights:
            continue
        shape = weights[weight].shape
        if (len(lhs.ty.shape) == 2 and len(shape) == 2 and uses[weight] == 1 and uses[rhs] == 1
                and shape[0] % block[0] == 0 and shape[1] % block[1] == 0
                and lhs.ty.dtype == weight.ty.dtype == var.ty.dtype):
            found[var] = (rhs, weight)
    return found


@relax.expr_functor.mutator
class _SparsifyLinears(relax.PyExprMutator):
    """Replaces each chosen matmul by a call_tir of its sparse kernel and drops its permute_dims."""

    def __init__(self, mod: tvm.IRModule, linears: dict, kernels: dict, bsr_params: dict):
        super().__init__(mod)
        self.linears = linears  # matmul var -> (permute var, W)
        self.dropped = {permute for permute, _ in linears.values()}
        self.kernels = kernels  # W -> (its kernel, generic in M; the block rows of its output, or None: [M, N])
        self.bsr_params = bsr_params  # W -> its arrays' relax Vars

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.dropped:
            return
        if binding.var not in self.linears:
            super().visit_var_binding_(binding)
            return
        weight = self.linears[binding.var][1]
        kernel, block_rows = self.kernels[weight]
        lhs = self.visit_expr(binding.value.args[0])
        (n, _), dtype = weight.ty.shape, weight.ty.dtype
        gvar = self.builder_.add_func(kernel, "bsr_matmul")
        m = lhs.ty.shape[0]
        if block_rows is None:  # the CPU kernels write [M, N]
            output = relax.call_tir(gvar, [lhs, *self.bsr_params[weight]], relax.TensorType((m, n), dtype))
        else:
            blocked = self.builder_.emit(relax.call_tir(gvar, [lhs, *self.bsr_params[weight]],
                                                        relax.TensorType((m, block_rows, int(n) // block_rows), dtype)))
            output = relax.op.reshape(blocked, (m, n))
        is_output = not isinstance(binding.var, relax.DataflowVar)
        self.set_var_remap(binding.var, (self.builder_.emit_output if is_output else self.builder_.emit)(output))


def sparse_kernel(weight: np.ndarray, chosen: str, block: tuple[int, int],
                  target: Target) -> tuple[dict[str, np.ndarray], tirx.PrimFunc, int | None]:
    """(The arrays, the kernel generic in M, its output's block rows or None for [M, N]) of `chosen` for
    `weight`: a storage's C kernel (compile/kernels/bsr.py), or the TIR kernel over fp32 BSR (`sparse_choice.TIR`,
    for any block, and CUDA's)."""
    n, k = weight.shape
    storage = storage_of(chosen)
    capabilities = Capabilities.of(target)
    m = tirx.Var("m", "int64")
    if storage != "tir":
        arrays = bsr.pack(storage, weight, block)
        return arrays, bsr.bsr_kernel(storage, m, k, n, arrays, block, capabilities.lanes), None
    data, indices, indptr = to_bsr(weight, block)
    kernel = bsr_matmul_func(k, len(indices), block, n // block[0], "float32", target)
    return {"data": data, "indices": indices, "indptr": indptr}, kernel, n // block[0]


def _report(choices: list[dict], densities: list[float], rewritten: list[float], choice: SparseChoice) -> dict:
    return {
        "rewritten": len(rewritten),
        "kept_dense": len(densities) - len(rewritten),
        "density": float(np.mean(rewritten)) if rewritten else None,
        "block": list(choice.block),
        "choice": (f"timed here at {TIMED_ROWS} rows, gated by accuracy" if choice.timer is not None
                   else f"block density <= {choice.max_density:g}"),
        "choices": choices,
    }


def sparsify(mod: tvm.IRModule, params: list, choice: SparseChoice) -> tuple[tvm.IRModule, list, dict]:
    """Rewrite `main`'s eligible linears to sparse kernels; weights must still be parameters of `main`.

    A weight is a candidate when it feeds only `matmul(x [M, K], permute_dims(W))` and its block density
    is <= `choice.max_density`; `choice` decides, per candidate, dense or which sparse storage
    (compile/sparse_choice.py). A rewritten weight's parameter is replaced, in place, by its kernel's arrays,
    in the signature and in the returned params (CPU tvm Tensors, the form `lift.lift_and_transform` takes).
    """
    func = mod["main"]
    num_input = int(func.attrs["num_input"])
    weights = {p: v if isinstance(v, np.ndarray) else v.numpy() for p, v in zip(func.params[num_input:], params)}
    linears = _eligible_linears(func, weights, choice.block)
    densities = {w: block_density(weights[w], choice.block) for _, w in linears.values()}
    linears = {var: (p, w) for var, (p, w) in linears.items() if densities[w] <= choice.max_density}
    choices, kernels, bsr_values, bsr_params = [], {}, {}, {}
    for var, (_, weight) in list(linears.items()):
        decided = choice.decide(weights[weight], weight.name)
        if decided["candidates"]:
            choices.append(_choice_record(weight.name, densities[weight], decided))
        if decided["chosen"] == DENSE:
            del linears[var]
            continue
        arrays, kernel, block_rows = sparse_kernel(weights[weight], decided["chosen"], choice.block, choice.target)
        kernels[weight], bsr_values[weight] = (kernel, block_rows), list(arrays.values())
        bsr_params[weight] = [relax.Var(f"{weight.name}_bsr_{part}", relax.TensorType(a.shape, str(a.dtype)))
                              for part, a in arrays.items()]
    mutator = _SparsifyLinears(mod, linears, kernels, bsr_params)
    body = mutator.visit_expr(func).body
    new_params, new_values = list(func.params[:num_input]), []
    for param in func.params[num_input:]:
        new_params.extend(bsr_params.get(param, [param]))
        new_values.extend(bsr_values.get(param, [weights[param]]))
    new_func = relax.Function(new_params, body, func.ret_ty, func.is_pure, func.attrs)
    mutator.builder_.update_func(mod.get_global_var("main"), new_func)
    report = _report(choices, list(densities.values()), [densities[w] for w in bsr_params], choice)
    return mutator.builder_.get(), [tvm.runtime.tensor(np.ascontiguousarray(v)) for v in new_values], report


def _choice_record(name: str, density: float, decided: dict) -> dict:
    """The manifest's record of one timed weight (`LinearChoice`)."""
    candidates = decided["candidates"]
    dense = next(c for c in candidates if c["name"] == DENSE)
    sparse = min((c for c in candidates if c["name"] != DENSE), key=lambda c: c["ms"])
    return {"weight": name, "density": round(density, 4), "precision": decided["precision"],
            "candidates": candidates, "chosen": decided["chosen"], "dense_ms": dense["ms"],
            "sparse_ms": sparse["ms"], "bsr": decided["chosen"] != DENSE}


@dataclass
class SparseWeights:
    """`main`'s weights, which `SparsifyLinears` reads and replaces (with its report): the pass
    changes `main`'s signature, so its weights travel beside the module."""

    params: list
    report: dict | None = None


def SparsifyLinears(weights: SparseWeights, choice: SparseChoice) -> tvm.transform.Pass:
    """`sparsify` as a pass over `weights`."""
    def rewrite(mod: tvm.IRModule) -> tvm.IRModule:
        mod, weights.params, weights.report = sparsify(mod, weights.params, choice)
        return mod

    return as_pass("SparsifyLinears", rewrite)
