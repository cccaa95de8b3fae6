"""torch.export with dynamic batch and sequence, then import into TVM Relax."""

from __future__ import annotations

import hashlib
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch
import tvm
from tvm import relax

from artifact.packed_batch import PACKED_INPUT_NAMES, pack_batch

from .checkpoint import INPUT_NAMES, BertWrapper, example_inputs, returning_tokens
from .packed_model import PackedBertWrapper


@dataclass
class ImportedModel:
    """The Relax module (weights still function parameters) and the weights in order."""

    mod: tvm.IRModule
    params: list[tvm.runtime.Tensor]


def _amax(node, importer) -> relax.Var:
    """torch.amax as Relax's max reduction: the importer has none for it, and `max(dim).values`
    imports as a top-k, which TVM's runtime library (all the server loads) cannot run."""
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", [])
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return importer.block_builder.emit(
        relax.op.max(importer.env[node.args[0]], axis=list(dim) or None, keepdims=keepdim))


def _slice(node, importer) -> relax.Var:
    """A step-1 slice whose bounds are provably inside the tensor (every symbolic size at least 1) as a
    `strided_slice` that assumes so: its shape is then end - begin, where the importer's own gives the
    clamped `min(max(...))` form, which later passes cannot always type (MPNet's skewed relative
    positions, compile/families.skewed); any other slice as the importer writes it."""
    from tvm.sym.analyzer import Analyzer

    x = importer.env[node.args[0]]
    dim, begin, end, step = [*node.args[1:], *(0, 0, None, 1)[len(node.args) - 1:]][:4]  # slice's defaults
    begin, end = (importer.env[v] if isinstance(v, torch.fx.Node) else v for v in (begin or 0, end))
    shape = importer.shape_of(x)
    if step == 1 and end is not None and shape is not None:
        extent, analyzer = shape[dim % len(shape)], Analyzer()
        bounds = [_i64(v) if isinstance(v, int) else v for v in (begin, end, extent)]
        for var in {v for e in bounds for v in tvm.tirx.analysis.undefined_vars(e)}:
            analyzer.bind(var, tvm.ir.Range(_i64(1), _i64(2 ** 31)))
        first, last, size = bounds
        if all(analyzer.can_prove(analyzer.canonical_simplify(high - low) >= 0)
               for low, high in ((_i64(0), first), (first, last), (last, size))):
            return importer.block_builder.emit(relax.op.strided_slice(
                x, [dim % len(shape)], [first], [last], [1], assume_inbound=True))
    return importer._slice(node)


def _i64(value: int):
    return tvm.tirx.IntImm("int64", value)


CONVERTERS = {"amax.default": _amax, "slice.Tensor": _slice}  # ops the importer lacks or writes unusably
# Exports kept in this process, by `export_key`: the levels of one compile (and a process that
# compiles one checkpoint in several settings) export it once. A few entries, each a weight set.
EXPORTS_KEPT = 4
_exports: OrderedDict[str, ImportedModel] = OrderedDict()


def export_key(wrapper: BertWrapper, *bounds) -> str:
    """What the exported graph depends on: the wrapper's code path (family config, task, pooling),
    its weights' bytes (pruning changes them) and the export's bounds and layout."""
    config = wrapper.bert.config
    digest = hashlib.blake2b(repr((
        type(wrapper).__qualname__, wrapper.task, wrapper.pooling, config.to_json_string(),
        getattr(config, "_attn_implementation", None), bounds)).encode())
    for name, tensor in wrapper.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def export_and_import(wrapper: BertWrapper, max_batch: int, max_seq: int, vocab_size: int,
                      layout: str = "padded") -> ImportedModel:
    """Export with symbolic (batch, seq) and import, keeping weights as parameters. The packed
    layout (`PackedBertWrapper`) adds a symbolic token count.

    Weights stay parameters (not constants) because CombineParallelMatmul only matches
    Vars, and LiftTransformParams later moves weight-only work out of `main`. An export already
    made in this process with the same key is reused (the module is immutable; the passes copy
    the weights they change).
    """
    key = export_key(wrapper, max_batch, max_seq, vocab_size, layout)
    if key in _exports:
        _exports.move_to_end(key)
    else:
        _exports[key] = _export(wrapper, max_batch, max_seq, vocab_size, layout)
        while len(_exports) > EXPORTS_KEPT:
            _exports.popitem(last=False)
    kept = _exports[key]
    return ImportedModel(mod=kept.mod, params=list(kept.params))


def _export(wrapper: BertWrapper, max_batch: int, max_seq: int, vocab_size: int, layout: str) -> ImportedModel:
    from torch.export import Dim
    from tvm.relax.frontend.torch import from_exported_program

    # Export at batch 2 x seq 8: an example of 1 would specialise the dimension to 1, and one
    # equal to its upper bound breaks the import, so the bounds are at least one above it.
    # (The loader enforces the configured max_batch; this is only the graph's upper bound.)
    batch = Dim("batch", min=1, max=max(max_batch, 3))
    seq = Dim("seq", min=1, max=max(max_seq, 9))
    dynamic_shapes = {name: {0: batch, 1: seq} for name in INPUT_NAMES}
    args = example_inputs(2, 8, vocab_size)
    if layout == "packed":  # 11 real tokens padded to 13 rows: no dimension equals another
        tokens = Dim("tokens", min=1, max=max(max_batch * max_seq, 14))
        dynamic_shapes = {name: {0: tokens} for name in PACKED_INPUT_NAMES}
        dynamic_shapes["gather"] = dynamic_shapes["attention_mask"] = {0: batch, 1: seq}
        ids, mask, type_ids, _ = (x.numpy() for x in args)
        mask[:] = 0
        mask[0, :8], mask[1, :3] = 1, 1
        args = tuple(torch.from_numpy(x) for x in pack_batch(ids, mask, type_ids, tokens=13))
    with returning_tokens(wrapper), torch.no_grad(), warnings.catch_warnings():
        if layout == "packed":
            wrapper = PackedBertWrapper(wrapper)
        warnings.simplefilter("ignore")
        program = torch.export.export(wrapper, args, dynamic_shapes=dynamic_shapes)
        mod = from_exported_program(program, keep_params_as_input=True, custom_convert_map=CONVERTERS)
    mod, params = relax.frontend.detach_params(mod)
    return ImportedModel(mod=mod, params=list(params["main"]))


def symbolic_dims(mod: tvm.IRModule) -> dict[str, tvm.tirx.Var]:
    """`main`'s symbolic "batch" and "seq" (from its first [batch, seq] input) and, packed, "tokens"."""
    params = mod["main"].params
    if len(params[0].ty.shape) == 2:  # padded: input_ids [batch, seq]
        batch, seq = params[0].ty.shape
        return {"batch": batch, "seq": seq}
    batch, seq = params[PACKED_INPUT_NAMES.index("gather")].ty.shape
    return {"tokens": params[0].ty.shape[0], "batch": batch, "seq": seq}
