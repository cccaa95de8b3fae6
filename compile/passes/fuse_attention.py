"""FuseAttention: each attention core of an imported BERT becomes one call of the CPU attention kernel.

The imported attention is a chain of high-level Relax ops: Q, K and V sliced from the linear
layers' output (a split of the Q/K/V concatenation, a gather of each sequence's rows in the
packed layout), reshaped and transposed per head, `matmul(Q, K^T)`, scaled, plus an additive mask
of shape [batch, 1, 1, seq], softmax over the keys, `matmul(P, V)`, and the way back to
[rows, hidden] (a scatter to the packed rows). A score bias may be added to the scaled scores before the
mask, proved like the rest: a [1 or batch, heads, seq, seq] tensor (its add's broadcast is its index map,
[b or 0, h, i, j] for query i and key j of sequence b), or views of a [rows, heads] table of relative
positions that read it at [(j - i) mod rows, h] (MPNet's, computed once per call and read by every layer;
the kernel then reads the table, and the seq x seq views of it are dropped). The pass anchors on the softmax, follows the chain
to both matmuls and to the end of the output's view ops, and proves what each view chain does by
composing its index maps (reshape, permute_dims, broadcast_to, a split's offset, a gather): Q must
read Q_src[row(b, i), q_off + h * D + d], K and V likewise, and the end of the chain must hold
head h's context of query i at [row(b, i), h * D + d], with row(b, i) = b * seq + i (padded) or
the packed layout's gather[b, i] (whose inverse the scatter is). Only then is the end of the
chain rebound to the kernel's output; DeadCodeElimination drops the rest. Anything else (another
mask shape, a head size the lanes do not divide, an unbounded sequence) is left as it was.

A sliding-window layer's mask (compile/families.py `windowed`) is the same [batch, 1, 1, seq] mask
with the keys farther than the window from each query replaced by a large negative:
`where(abs(i - j) > window, min, mask)` over i, j = arange(seq) (expand_dims'd against each other) of
the scores' own sequence axis. That is recognised exactly, and the kernel is written with the window.

Symbolic dimensions (batch, token count, the generic library's sequence) make some of those
index maps unprovable in general; they are proved for every combination of a few sizes instead
(`SAMPLE_SIZES`), over all indices.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.sym.analyzer import Analyzer

from ..capabilities import KernelConfig
from ..kernels import attention
from ..kernels.attention import AttentionShape

_OP = {name: tvm.ir.Op.get(f"relax.{name}") for name in (
    "nn.softmax", "add", "multiply", "divide", "matmul", "reshape", "permute_dims", "broadcast_to", "take", "split",
    "where", "greater", "abs", "subtract", "expand_dims", "arange", "strided_slice")}
VIEWS = ("reshape", "permute_dims", "broadcast_to", "take")
SAMPLE_SIZES = (1, 2, 3, 7, 16)  # values a symbolic dimension takes in the proofs


def _i64(value) -> tirx.PrimExpr:
    return tirx.IntImm("int64", value) if isinstance(value, int) else value


def _call(value, *names) -> bool:
    return isinstance(value, relax.Call) and any(value.op.same_as(_OP[name]) for name in names)


def _shape(expr: relax.Expr) -> list:
    return list(expr.ty.shape)


def _flatten(index: list, shape: list):
    flat = _i64(0)
    for i, extent in zip(index, shape):
        flat = flat * extent + i
    return flat


def _unflatten(flat, shape: list) -> list:
    index = []
    for extent in reversed(shape):
        index.append(tirx.floormod(flat, extent))
        flat = tirx.floordiv(flat, extent)
    return index[::-1]


class _Chains:
    """Bindings of `main`, and index maps through its view ops."""

    def __init__(self, func: relax.Function):
        self.value: dict[relax.Var, relax.Expr] = {}
        self.users: dict[relax.Var, list[relax.Var]] = {}
        for block in func.body.blocks:
            for binding in block.bindings:
                self.value[binding.var] = binding.value
                for used in relax.analysis.free_vars(binding.value):
                    self.users.setdefault(used, []).append(binding.var)
        self.gathers: dict[tirx.Var, tuple[relax.Expr, list]] = {}

    def bound(self, expr: relax.Expr) -> relax.Expr | None:
        return self.value.get(expr) if isinstance(expr, relax.Var) else None

    def only_user(self, var: relax.Var) -> relax.Var | None:
        users = self.users.get(var, [])
        return users[0] if len(users) == 1 else None

    def trace(self, expr: relax.Expr, index: list, conditions: list | None = None) -> tuple[relax.Expr, list]:
        """The tensor a chain of views reads from and the index it reads for `index`. A gather
        (`take` by a 1-D index tensor) reads at a fresh var, recorded in `self.gathers`. With
        `conditions` (a list), gathers end the chain, and slices (`expand_dims`, `strided_slice` by
        step 1) are views too, each adding to `conditions` the (left, right) pairs that must be
        equal for its index map to hold (a slice's start is not negative)."""
        while True:
            value = self.bound(expr)
            if conditions is not None and _call(value, "expand_dims"):
                added = {int(a) % len(index) for a in value.attrs.axis}
                index, expr = [x for k, x in enumerate(index) if k not in added], value.args[0]
                continue
            if conditions is not None and _call(value, "strided_slice"):
                axes, begins, _, strides = ([_i64(x) if isinstance(x, int) else x for x in arg.fields]
                                            for arg in value.args[1:5])
                if any(not (isinstance(step, tirx.IntImm) and int(step) == 1) for step in strides):
                    return expr, index
                index = list(index)
                for axis, begin in zip(axes, begins):
                    index[int(axis) % len(index)] = index[int(axis) % len(index)] + begin
                    conditions.append((tirx.max(begin, _i64(0)), begin))
                expr = value.args[0]
                continue
            if conditions is not None and _call(value, "take"):
                return expr, index
            if isinstance(value, relax.TupleGetItem):
                split = self.bound(value.tuple_value)
                if not _call(split, "split") or isinstance(split.attrs.indices_or_sections, (int, tirx.IntImm)):
                    return expr, index
                starts = [0] + [int(x) for x in split.attrs.indices_or_sections]
                axis = int(split.attrs.axis) % len(index)
                index = list(index)
                index[axis] = index[axis] + starts[value.index]
                expr = split.args[0]
            elif _call(value, "reshape"):
                index = _unflatten(_flatten(index, _shape(expr)), _shape(value.args[0]))
                expr = value.args[0]
            elif _call(value, "permute_dims"):
                axes = [int(a) for a in value.attrs.axes] if value.attrs.axes is not None else \
                    list(range(len(index)))[::-1]
                source = [None] * len(index)
                for position, axis in enumerate(axes):
                    source[axis] = index[position]
                index, expr = source, value.args[0]
            elif _call(value, "broadcast_to"):
                source_shape, offset = _shape(value.args[0]), len(index) - len(_shape(value.args[0]))
                target_shape = _shape(expr)
                index = [_i64(0) if (isinstance(source_shape[k], tirx.IntImm) and int(source_shape[k]) == 1
                                     and not (isinstance(target_shape[k + offset], tirx.IntImm)
                                              and int(target_shape[k + offset]) == 1))
                         else index[k + offset] for k in range(len(source_shape))]
                expr = value.args[0]
            elif _call(value, "take") and len(_shape(value.args[1])) == 1:
                axis = int(value.attrs.axis) % len(index)
                row = tirx.Var(f"gathered{len(self.gathers)}", "int64")
                self.gathers[row] = (value.args[1], [index[axis]])
                index = list(index)
                index[axis] = row
                expr = value.args[0]
            else:
                return expr, index


@dataclass(frozen=True)
class _Core:
    """One matched attention: what the kernel reads and which binding its output replaces."""

    end: relax.Var
    sources: tuple[relax.Expr, relax.Expr, relax.Expr]
    offsets: tuple[int, int, int]
    bias: relax.Expr  # [batch, 1, 1, seq]
    score_bias: relax.Expr | None  # what the kernel reads of a score bias added before the mask
    gather: relax.Expr | None  # the packed layout's [batch, seq] row map; None: padded rows
    shape: AttentionShape


class _Matcher:
    def __init__(self, func: relax.Function, lanes: int):
        self.func = func
        self.lanes = lanes
        self.chains = _Chains(func)
        self.upper = {name: int(bound) for name, bound in _bounds(func).items()}
        self.symbols: dict[str, tirx.Var] = {}

    def cores(self) -> list[_Core]:
        found = []
        for var, value in self.chains.value.items():
            if _call(value, "nn.softmax") and int(value.attrs.axis) in (-1, 3):
                core = self._match(var, value)
                if core is not None:
                    found.append(core)
        return found

    def _extent(self, extent, name: str):
        """A static extent as an int, a symbolic one as the kernel's own var (one per name, so that
        every layer shares one kernel)."""
        if isinstance(extent, tirx.IntImm):
            return int(extent)
        return self.symbols.setdefault(name, tirx.Var(name, "int64"))

    def _window(self, mask: relax.Expr) -> tuple[relax.Expr, int | None]:
        """(the [batch, 1, 1, seq] mask, the window) of a sliding-window mask `where(abs(i - j) > window,
        a large negative, mask)` over i and j of one arange; else (`mask`, None)."""
        chains = self.chains
        where = chains.bound(mask)
        if not _call(where, "where"):
            return mask, None
        condition, masked, kept = where.args
        masked, greater = self._constant(masked), chains.bound(condition)
        if masked is None or masked > attention.REAL_KEY_BIAS or not _call(greater, "greater") or \
                self._constant(greater.args[1]) is None:
            return mask, None
        distance = chains.bound(greater.args[0])
        difference = chains.bound(distance.args[0]) if _call(distance, "abs") else None
        if not _call(difference, "subtract"):
            return mask, None
        axes = [chains.bound(x) for x in difference.args]
        if not all(_call(x, "expand_dims") and len(x.attrs.axis) == 1 for x in axes) or \
                sorted(int(x.attrs.axis[0]) for x in axes) != [0, 1] or not axes[0].args[0].same_as(axes[1].args[0]):
            return mask, None
        arange = chains.bound(axes[0].args[0])
        if not (_call(arange, "arange") and _arange_of(arange, _shape(kept)[-1])):
            return mask, None
        return kept, int(self._constant(greater.args[1]))

    def _constant(self, expr: relax.Expr) -> float | None:
        """The value of a scalar constant (or of a var bound to one)."""
        expr = self.chains.bound(expr) or expr
        return float(expr.value.numpy()) if isinstance(expr, tvm.ir.expr.Constant) and expr.value.numpy().size == 1 else None

    def _scores(self, softmax: relax.Call):
        """(scores [B*H, S, S] matmul, its 4-D shape, scale, bias, window, score bias or None) of
        softmax(scores * scale [+ score bias] + bias), the bias a [B, 1, 1, S] mask, or a sliding window's mask
        of one (`_window`)."""
        add = self.chains.bound(softmax.args[0])
        if not _call(add, "add"):
            return None
        for scaled, mask in (add.args, add.args[::-1]):
            bias, window = self._window(mask)
            bias_shape = _tensor_shape(bias)
            if len(bias_shape) != 4 or not all(_is_one(d) for d in bias_shape[1:3]):
                continue
            scaling, score_bias = self.chains.bound(scaled), None
            if _call(scaling, "add"):  # scores * scale + score bias
                scaling, score_bias = next(((self.chains.bound(x), other) for x, other in (
                    scaling.args, scaling.args[::-1]) if _call(self.chains.bound(x), "multiply", "divide")), (None, None))
            if _call(scaling, "multiply", "divide") and isinstance(scaling.args[1], tvm.ir.expr.Constant):
                factor = float(scaling.args[1].value.numpy())
                scale = factor if _call(scaling, "multiply") else 1.0 / factor
                scores = scaling.args[0]
                shape4 = _shape(scores)
                reshaped = self.chains.bound(scores)
                if _call(reshaped, "reshape"):
                    scores = reshaped.args[0]
                if _call(self.chains.bound(scores), "matmul") and len(shape4) == 4:
                    return scores, shape4, scale, bias, window, score_bias
        return None

    def _match(self, var: relax.Var, softmax: relax.Call) -> _Core | None:
        chains = self.chains
        scores = self._scores(softmax)
        if scores is None:
            return None
        scores_var, (batch, heads, seq, _), scale, bias, window, score_bias = scores
        if not isinstance(heads, tirx.IntImm):
            return None
        q3, k3 = chains.bound(scores_var).args
        head_size = _shape(q3)[-1]
        if not (isinstance(head_size, tirx.IntImm) and attention.supports(int(head_size), self.lanes)):
            return None
        context = self._weighted_sum(var)
        if context is None:
            return None
        context_var, v3 = context
        end = context_var
        while (user := chains.only_user(end)) is not None and any(_call(chains.value[user], op) for op in VIEWS):
            end = user
        max_seq = int(seq) if isinstance(seq, tirx.IntImm) else self.upper.get(getattr(seq, "name", ""), None)
        if max_seq is None:
            return None
        sizes = _Sizes(batch, int(heads), seq, int(head_size))
        read_bias = (None, "", 0) if score_bias is None else self._score_bias(sizes, score_bias)
        if read_bias is None:
            return None
        proved = self._prove(sizes, q3, k3, v3, context_var, end)
        if proved is None:
            return None
        sources, offsets, gather, rows = proved
        shape = AttentionShape(batch=self._extent(batch, "batch"), seq=self._extent(seq, "seq"),
                               rows=self._extent(rows, "rows"), heads=int(heads), head_size=int(head_size),
                               max_seq=max_seq, scale=scale, packed=gather is not None,
                               widths=tuple(int(_shape(s)[1]) for s in sources), offsets=offsets, window=window,
                               score_bias=read_bias[1], table_rows=read_bias[2])
        return _Core(end, sources, offsets, bias, read_bias[0], gather, shape)

    def _score_bias(self, sizes: "_Sizes", score_bias: relax.Expr):
        """(what the kernel reads, kind, table rows) of a score bias added to the [batch, heads, seq, seq] scores,
        by what its index map is proved to be for query i and key j of head h in sequence b: "relative", its view
        chain reads a [rows, heads] table at [(j - i) mod rows, h] with rows >= 2 x seq - 1 (MPNet's, from its
        relative positions' table); "shared", it is [1, heads, seq, seq], read at [0, h, i, j] by the add's
        broadcast; "batched", [batch, heads, seq, seq] at [b, h, i, j]; None: neither (left unfused)."""
        index = _index_vars()
        b, h, i, j, _ = index.values()
        conditions = []
        table, read = self.chains.trace(score_bias, [b, h, i, j], conditions)
        shape = _tensor_shape(table)
        if len(read) == 2 and len(shape) == 2:
            rows, seq = shape[0], sizes.seq
            claims = [*conditions, (read[0], tirx.floormod(j - i, rows)), (read[1], h),
                      (shape[1], _i64(sizes.heads)), (tirx.max(rows, 2 * seq - 1), rows)]
            if _proved_for_samples(sizes, claims, index):
                return table, "relative", self._extent(rows, "table_rows")
        shape = _tensor_shape(score_bias)
        if len(shape) != 4:
            return None
        rest = [(shape[1], _i64(sizes.heads)), (shape[2], sizes.seq), (shape[3], sizes.seq)]
        for kind, first in (("shared", _i64(1)), ("batched", sizes.batch)):
            if _proved_for_samples(sizes, [(shape[0], first), *rest], index):
                return score_bias, kind, 0
        return None

    def _weighted_sum(self, probabilities: relax.Var):
        """(context [B*H, S, D], V [B*H, S, D]) of matmul(view(probabilities), V)."""
        chains, current = self.chains, probabilities
        while (user := chains.only_user(current)) is not None:
            value = chains.value[user]
            if _call(value, "matmul"):
                return (user, value.args[1]) if value.args[0].same_as(current) else None
            if not _call(value, "reshape", "broadcast_to"):
                return None
            current = user
        return None

    def _prove(self, sizes: "_Sizes", q3, k3, v3, context, end):
        """(sources, column offsets, gather or None, source rows) when the view chains read Q, K, V
        and write the context where the kernel does, for every sample of the symbolic sizes."""
        chains = self.chains
        index = _index_vars()
        b, h, i, j, d = index.values()
        bh = b * sizes.heads + h
        claims, sources, columns, gathers = [], [], [], set()
        for operand, position, axes in ((q3, i, [bh, i, d]), (k3, j, [bh, d, j]), (v3, j, [bh, j, d])):
            source, read = chains.trace(operand, axes)
            if len(read) != 2:
                return None
            row, column = read
            if isinstance(row, tirx.Var) and row in chains.gathers:  # packed: a gathered row
                gather, at = chains.trace(*chains.gathers[row])
                if len(at) != 2:
                    return None
                gathers.add(gather)
                claims += [(at[0], b), (at[1], position)]
            else:
                claims.append((row, b * sizes.seq + position))
            sources.append(source)
            columns.append(column - (h * sizes.head_size + d))
        if len(gathers) > 1 or not all(_same_extent(_shape(s)[0], _shape(sources[0])[0]) for s in sources):
            return None
        gather = next(iter(gathers), None)
        r, c = tirx.Var("r", "int64"), tirx.Var("c", "int64")
        end_shape = _shape(end)
        before = set(chains.gathers)
        if len(end_shape) == 2:
            written, at = chains.trace(end, [r, c])
        elif len(end_shape) == 3 and gather is None:
            written, at = chains.trace(end, [b, i, c])
        else:
            return None
        scattered = [var for var in chains.gathers if var not in before]
        if not written.same_as(context) or len(at) != 3 or len(scattered) != (gather is not None):
            return None
        # where the kernel puts head h's context of query i: row b * seq + i (padded), or the packed
        # row whose scatter index is b * seq + i (the inverse of gather, by the packed layout's contract)
        placed = {c: h * sizes.head_size + d, (scattered[0] if scattered else r): b * sizes.seq + i}
        at = [_substitute(e, placed) for e in at]
        claims += [(at[0], bh), (at[1], i), (at[2], d)]
        if not _proved_for_samples(sizes, claims, index):
            return None
        offsets = [_constant(sizes, column, index) for column in columns]
        if any(offset is None for offset in offsets):
            return None
        return tuple(sources), tuple(offsets), gather, _shape(sources[0])[0]


@dataclass(frozen=True)
class _Sizes:
    batch: object
    heads: int
    seq: object
    head_size: int


def _bounds(func: relax.Function) -> dict:
    attrs = func.attrs or {}
    upper = attrs.get("tir_var_upper_bound", {}) if "tir_var_upper_bound" in attrs else {}
    return {name: value for name, value in upper.items()}


def _arange_of(arange: relax.Call, extent) -> bool:
    """Whether `arange` is arange(0, extent, 1)."""
    start, end, step = arange.args
    return _same_extent(start, _i64(0)) and _same_extent(step, _i64(1)) and _same_extent(end, extent)


def _same_extent(a, b) -> bool:
    return Analyzer().can_prove_equal(a, b)


def _is_one(extent) -> bool:
    return isinstance(extent, tirx.IntImm) and int(extent) == 1


def _tensor_shape(expr: relax.Expr) -> list:
    return _shape(expr) if isinstance(expr.ty, relax.TensorType) and expr.ty.shape is not None else []


def _index_vars() -> dict:
    return {name: tirx.Var(name, "int64") for name in "bhijd"}


def _samples(sizes: _Sizes, symbols: list[tirx.Var]):
    for values in itertools.product(SAMPLE_SIZES, repeat=len(symbols)):
        yield dict(zip(symbols, (_i64(v) for v in values)))


def _analyzer(sizes: _Sizes, binding: dict, index_vars: dict) -> Analyzer:
    analyzer = Analyzer()
    extents = {"b": sizes.batch, "h": sizes.heads, "i": sizes.seq, "j": sizes.seq, "d": sizes.head_size}
    for name, var in index_vars.items():
        extent = _i64(extents[name])
        extent = _substitute(extent, binding)
        analyzer.bind(var, tvm.ir.Range(_i64(0), extent))
    return analyzer


def _substitute(expr, binding: dict):
    return tvm_ffi.structural_map(expr, [(tirx.Var, lambda var: binding.get(var, var))]) if binding else expr


def _free_symbols(exprs, index_vars: dict) -> list[tirx.Var]:
    """The symbolic sizes `exprs` mention: every free var but the index vars."""
    found: list[tirx.Var] = []
    for expr in exprs:
        for var in tirx.analysis.undefined_vars(expr):
            if var not in found and not any(var.same_as(v) for v in index_vars.values()):
                found.append(var)
    return found


def _proved_for_samples(sizes: _Sizes, pairs, index_vars: dict) -> bool:
    exprs = [e for pair in pairs for e in pair] + [_i64(sizes.batch), _i64(sizes.seq)]
    symbols = _free_symbols(exprs, index_vars)
    for binding in _samples(sizes, symbols) if symbols else [{}]:
        analyzer = _analyzer(sizes, binding, index_vars)
        for left, right in pairs:
            left, right = (_substitute(e, binding) for e in (left, right))
            if not _equal(analyzer, left, right):
                return False
    return True


def _equal(analyzer: Analyzer, left, right) -> bool:
    """Whether `left` == `right` provably; where `left` is x mod m (a skewed view's column: the analyzer does
    not see (i * (m - 1) + j) mod m as (j - i) mod m), by x - y being a multiple of m, where `right` is y mod m,
    or is y itself with 0 <= y < m."""
    if analyzer.can_prove_equal(left, right):
        return True
    if not isinstance(left, tirx.FloorMod):
        return False
    x, m = left.a, left.b
    if isinstance(right, tirx.FloorMod) and analyzer.can_prove_equal(right.b, m):
        y = right.a
    elif analyzer.can_prove(right >= _i64(0)) and analyzer.can_prove(right < m):
        y = right
    else:
        return False
    return analyzer.can_prove_equal(tirx.floormod(x - y, m), _i64(0))


def _constant(sizes: _Sizes, offset, index_vars: dict) -> int | None:
    """The value of `offset` when it is the same constant for every sample, else None."""
    symbols = _free_symbols([offset, _i64(sizes.batch), _i64(sizes.seq)], index_vars)
    values = set()
    for binding in _samples(sizes, symbols) if symbols else [{}]:
        simplified = _analyzer(sizes, binding, index_vars).simplify(
            _substitute(offset, binding))
        if not isinstance(simplified, tirx.IntImm):
            return None
        values.add(int(simplified))
    return values.pop() if len(values) == 1 else None


@relax.expr_functor.mutator
class _Rebind(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, cores: list[_Core], kernels: KernelConfig):
        super().__init__(mod)
        self.cores = {core.end: core for core in cores}
        self.kernel_config = kernels
        self.kernels: dict[AttentionShape, relax.GlobalVar] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        core = self.cores.get(binding.var)
        if core is None:
            super().visit_var_binding_(binding)
            return
        kernel = self.kernels.get(core.shape)
        if kernel is None:
            kernel = self.kernels[core.shape] = self.builder_.add_func(
                attention.write_attention(core.shape, self.kernel_config), attention.KERNEL_NAME)
        args = [self.visit_expr(x) for x in (*core.sources, core.bias)]
        if core.score_bias is not None:
            args.append(self.visit_expr(core.score_bias))
        if core.gather is not None:
            args.append(self.visit_expr(core.gather))
        end_shape = _shape(binding.var)
        rows = _shape(core.sources[0])[0] if core.gather is not None else end_shape[0] * (
            end_shape[1] if len(end_shape) == 3 else 1)
        output = relax.call_tir(kernel, args, relax.TensorType([rows, end_shape[-1]], "float32"))
        if len(end_shape) == 3:  # the padded layout's [batch, seq, hidden]: a view of the kernel's rows
            output = relax.op.reshape(self.builder_.emit(output), end_shape)
        emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output
        self.set_var_remap(binding.var, emit(output))


def fuse_attention_in(mod: tvm.IRModule, kernels: KernelConfig) -> tuple[tvm.IRModule, int]:
    """`mod` with every provable attention core of `main` on the fused kernel written as `kernels`
    says (its lanes, its products' arithmetic: attention.write_attention), and how many."""
    cores = _Matcher(mod["main"], kernels.capabilities.lanes).cores()
    if not cores:
        return mod, 0
    mutator = _Rebind(mod, cores, kernels)
    mutator.builder_.update_func(mod.get_global_var("main"), mutator.visit_expr(mod["main"]))
    return relax.transform.DeadCodeElimination(["main"])(mutator.builder_.get()), len(cores)


def fuse_attention(kernels: KernelConfig) -> tvm.transform.Pass:
    """Module pass form of `fuse_attention_in` (the first pass of the CPU pipeline)."""

    @tvm.transform.module_pass(opt_level=0, name="FuseAttention")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_attention_in(mod, kernels)[0]

    return _pass
