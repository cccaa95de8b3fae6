"""Block sparsity for BERT's linear layers: magnitude block pruning and a Relax BSR matmul.

Relax 0.27 has no sparse-dense op (Relay's `bsr_dense` is gone), so this module brings back what
TVM PR #5377 did for BERT: prune each chosen weight to a block density, store it as BSR
(data, indices, indptr) and compute `y = x @ W^T` with a TIR kernel that reads only the kept
blocks (compile/kernels/sparse.py). The kernel reads W in its torch [N, K] layout, so the
`permute_dims` of the dense path disappears instead of being done at run time.

Order in the compile stage: `prune_model` on the torch model before export (PyTorch and TVM then
see the same weights), import, `apply_strategy`, `sparsify` (weights must still be parameters of
`main`), then `LiftTransformParams`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import tvm
from tvm import relax, te, tirx
from tvm.target import Target

from ..build import make_target
from ..capabilities import Capabilities
from ..kernels import sparse
from . import as_pass
from .linears import bindings, transposed_linears

LAYERS = {  # module name suffixes: BERT, RoBERTa and XLM-R's, then DistilBERT's
    "ffn": ("intermediate.dense", "output.dense", "ffn.lin1", "ffn.lin2"),
    "attention_output": ("attention.output.dense", "attention.out_lin"),
    "qkv": ("attention.self.query", "attention.self.key", "attention.self.value",
            "attention.q_lin", "attention.k_lin", "attention.v_lin"),
}
DEFAULT_LAYERS = ("ffn", "attention_output")
TIMED_ROWS = 128  # activation rows the dense and BSR kernels of a weight are timed on



# ----------------------------------------------------------------------------- pruning and BSR


def _blocks(weight: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """`weight` [N, K] viewed as [N/R, K/C, R, C] blocks; refuses shapes the block does not divide."""
    rows, cols = block
    if weight.ndim != 2 or weight.shape[0] % rows or weight.shape[1] % cols:
        raise ValueError(f"block {rows}x{cols} does not divide weight of shape {tuple(weight.shape)}")
    n, k = weight.shape
    return weight.reshape(n // rows, rows, k // cols, cols).transpose(0, 2, 1, 3)


def block_density(weight: np.ndarray, block: tuple[int, int]) -> float:
    """Fraction of `block`-shaped blocks of `weight` holding any non-zero value."""
    return float(np.any(_blocks(weight, block) != 0, axis=(2, 3)).mean())


def prune_blocks(weight: np.ndarray, density: float, block: tuple[int, int]) -> np.ndarray:
    """A copy of `weight` [N, K] keeping only the round(density * blocks) blocks of largest L2 norm.

    At least one block is kept so the BSR form never has zero-sized buffers.
    """
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    blocks = _blocks(weight, block)
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


def to_bsr(weight: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`weight` [N, K] as BSR: data [nnz, R, C], indices [nnz] (block columns), indptr [N/R + 1].

    Blocks are stored row-major, so each block row's blocks are contiguous in `data`. An all-zero
    weight still stores one zero block, to keep every buffer non-empty.
    """
    blocks = _blocks(weight, block)
    nonzero = np.any(blocks != 0, axis=(2, 3))
    if not nonzero.any():
        nonzero[0, 0] = True
    data = np.ascontiguousarray(blocks[nonzero])
    indices = np.nonzero(nonzero)[1].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(nonzero.sum(axis=1))]).astype(np.int32)
    return data, indices, indptr


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
    """Replaces each chosen matmul by a call_tir of the BSR kernel and drops its permute_dims."""

    def __init__(self, mod: tvm.IRModule, linears: dict, bsr_params: dict, target: Target):
        super().__init__(mod)
        self.linears = linears  # matmul var -> (permute var, W)
        self.dropped = {permute for permute, _ in linears.values()}
        self.bsr_params = bsr_params  # W -> (data, indices, indptr) relax Vars
        self.target = target

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.dropped:
            return
        if binding.var not in self.linears:
            super().visit_var_binding_(binding)
            return
        weight = self.linears[binding.var][1]
        data, indices, indptr = self.bsr_params[weight]
        lhs = self.visit_expr(binding.value.args[0])
        (n, k), dtype = weight.ty.shape, weight.ty.dtype
        nnz, rows, cols = (int(d) for d in data.ty.shape)
        kernel = bsr_matmul_func(int(k), nnz, (rows, cols), int(n) // rows, dtype, self.target)
        gvar = self.builder_.add_func(kernel, "bsr_matmul")
        m = lhs.ty.shape[0]
        blocked = self.builder_.emit(relax.call_tir(
            gvar, [lhs, data, indices, indptr], relax.TensorType((m, int(n) // rows, rows), dtype)))
        output = relax.op.reshape(blocked, (m, n))
        is_output = not isinstance(binding.var, relax.DataflowVar)
        self.set_var_remap(binding.var, (self.builder_.emit_output if is_output else self.builder_.emit)(output))


def timed_choice(weight: np.ndarray, block: tuple[int, int], target: Target, rows: int = TIMED_ROWS) -> dict:
    """This weight's BSR kernel and the dense kernel, built for `target` and timed on `rows`
    activation rows here (median ms of interleaved runs)."""
    from ..kernels import dense
    from ..lowering import tir_pipeline
    from ..timing import interleaved_medians

    n, k = weight.shape
    lanes = Capabilities.of(target).lanes
    nt = dense.packed_panel_width(n, lanes) or n  # an unpackable width: one panel, as the dense path runs it
    x = te.placeholder((rows, k), "float32", name="x")
    panels = te.placeholder((n // nt, k, nt), "float32", name="panels")
    dense_func = dense.schedule_matmul(te.create_prim_func([x, panels, dense.packed_matmul_te(x, panels)]), lanes)
    data, indices, indptr = to_bsr(weight, block)
    sparse_func = sparse.bsr_matmul_cpu(rows, k, len(indices), block, n // block[0], "float32", lanes)
    built = {name: tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target,
                               tir_pipeline=tir_pipeline(target))  # as the library will be lowered
             for name, func in (("dense", dense_func.mod["main"]), ("sparse", sparse_func))}
    activations = np.random.default_rng(0).standard_normal((rows, k)).astype(np.float32)
    packed = np.ascontiguousarray(weight.reshape(n // nt, nt, k).transpose(0, 2, 1))
    arguments = {"dense": [activations, packed, np.zeros((rows, n), np.float32)],
                 "sparse": [activations, data, indices, indptr, np.zeros((rows, n // block[0], block[0]), np.float32)]}
    arguments = {name: [tvm.runtime.tensor(a) for a in args] for name, args in arguments.items()}
    stats = interleaved_medians({name: (lambda name=name: built[name]["main"](*arguments[name])) for name in built},
                                repeats=7, warmup=2, warm_calls=1)
    return {f"{name}_ms": round(stats[name]["median_s"] * 1e3, 4) for name in built}


def sparsify(mod: tvm.IRModule, params: list, block: tuple[int, int], max_density: float = 0.5,
             target: Target | None = None, timed: bool = False) -> tuple[tvm.IRModule, list[tvm.runtime.Tensor], dict]:
    """Rewrite `main`'s eligible linears to BSR kernels; weights must still be parameters of `main`.

    A weight is a candidate when it feeds only `matmul(x [M, K], permute_dims(W))` and its block
    density is <= `max_density`; with `timed` (the target runs here), a candidate is rewritten only
    where its BSR kernel beat the dense one on this CPU (`timed_choice`), else every candidate is.
    Its parameter is replaced, in place, by three (data, indices, indptr), in the signature and in
    the returned params (as CPU tvm Tensors, the form `lift.lift_and_transform` takes). The kernels
    are scheduled for `target` (host CPU by default), so build the result for that target.
    """
    target = target or make_target("cpu")
    func = mod["main"]
    num_input = int(func.attrs["num_input"])
    weights = {p: v if isinstance(v, np.ndarray) else v.numpy() for p, v in zip(func.params[num_input:], params)}
    linears = _eligible_linears(func, weights, block)
    densities = {w: block_density(weights[w], block) for _, w in linears.values()}
    linears = {var: (p, w) for var, (p, w) in linears.items() if densities[w] <= max_density}
    choices = []
    if timed:
        for var, (_, weight) in list(linears.items()):
            choice = {"weight": weight.name, "density": round(densities[weight], 4),
                      **timed_choice(weights[weight], block, target)}
            choice["bsr"] = choice["sparse_ms"] < choice["dense_ms"]
            choices.append(choice)
            if not choice["bsr"]:
                del linears[var]
    bsr_values, bsr_params = {}, {}
    for _, weight in linears.values():
        bsr_values[weight] = to_bsr(weights[weight], block)
        bsr_params[weight] = tuple(
            relax.Var(f"{weight.name}_bsr_{part}", relax.TensorType(value.shape, str(value.dtype)))
            for part, value in zip(("data", "indices", "indptr"), bsr_values[weight]))

    mutator = _SparsifyLinears(mod, linears, bsr_params, target)
    body = mutator.visit_expr(func).body
    new_params, new_values = list(func.params[:num_input]), []
    for param in func.params[num_input:]:
        new_params.extend(bsr_params.get(param, [param]))
        new_values.extend(bsr_values.get(param, [weights[param]]))
    new_func = relax.Function(new_params, body, func.ret_ty, func.is_pure, func.attrs)
    mutator.builder_.update_func(mod.get_global_var("main"), new_func)
    rewritten = [densities[w] for w in bsr_params]
    report = {
        "rewritten": len(rewritten),
        "kept_dense": len(densities) - len(rewritten),
        "density": float(np.mean(rewritten)) if rewritten else None,
        "block": list(block),
        "choice": f"timed here at {TIMED_ROWS} rows" if timed else f"block density <= {max_density:g}",
        "choices": choices,
    }
    return mutator.builder_.get(), [tvm.runtime.tensor(np.ascontiguousarray(v)) for v in new_values], report


@dataclass
class SparseWeights:
    """`main`'s weights, which `SparsifyLinears` reads and replaces (with its report): the pass
    changes `main`'s signature, so its weights travel beside the module."""

    params: list
    report: dict | None = None


def SparsifyLinears(weights: SparseWeights, block: tuple[int, int], max_density: float, target: Target,
                    timed: bool) -> tvm.transform.Pass:
    """`sparsify` as a pass over `weights`."""
    def rewrite(mod: tvm.IRModule) -> tvm.IRModule:
        mod, weights.params, weights.report = sparsify(mod, weights.params, block, max_density, target, timed)
        return mod

    return as_pass("SparsifyLinears", rewrite)
