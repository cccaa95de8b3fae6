"""`--precision int8`: every linear layer over int8 weights, activations quantized per token at run time.

The pass rewrites `matmul(x, permute_dims(W))`, for weights computed from parameters only (as
compile/passes/packing.py finds them, Q/K/V concatenations included), into

    scale_w = weight_scales(W)                          (per output channel: max |W[n, :]| / 127, or AVX2's
                                                          largest same-sign pair sum / 127)
    Wq      = int8(round(W / scale_w))
    panels  = Wq in the kernel's [N / panel, K / group, panel, group] layout
    colsum  = sum_k Wq[n, k]
    xq, scale_x, zero_x = quantize_rows(x)               (per token, u8 with a zero point, at run time,
                                                          kernels/row_quantize.py; a smoothing multiply folded in)
    y = int8_matmul(xq, scale_x, zero_x, panels, scale_w, colsum)  (int32, compile/kernels/int8.py)

with the micro-kernel the target's CPU runs best (`Capabilities.int8_kernel`: AVX-512 VNNI, AVX-VNNI, AVX2).

The weight-side ops sit in the weight-only part of `main`, so `LiftTransformParams` runs them at
compile time and the artifact ships the int8 panels and fp32 scales instead of the fp32 weights.
Attention (its two batch matmuls), layer norm, softmax, GELU and pooling stay fp32. The kernels
are TE computes, so FuseOps still fuses the bias / GELU / residual epilogue into the matmul.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from ..capabilities import Capabilities
from ..kernels import int8, row_quantize
from ..sentences import ACCURACY_SENTENCES
from . import as_pass
from .bf16 import bf16_linear
from .linears import rewrite_linears
from .packing import linears_on_weights
from .smooth import linear_modules

_MULTIPLY = tvm.ir.Op.get("relax.multiply")
SCHEME = ("int8: weights symmetric per output channel (compile time), activations asymmetric per token "
          "(uint8 with a zero point, run time)")


def quantize_linears(mod: tvm.IRModule, target: tvm.target.Target, keep: frozenset[str] = frozenset(),
                     keep_in_bf16: bool = False) -> tuple[tvm.IRModule, int]:
    """`mod` with `main`'s linears on int8 weights for `target`'s micro-kernel (`Capabilities.int8_kernel`) and
    panels (`int8.panel_width`), and how many were quantized (run before LiftTransformParams and
    before compile/passes/packing.py, which packs what is left in fp32). A linear over a torch Linear
    in `keep` (its `smooth.module_key`) stays out of int8: on bf16 panels when `keep_in_bf16`, else fp32."""
    capabilities = Capabilities.of(target)
    kernel, amx_tiles = capabilities.int8_kernel, capabilities.amx
    linears = linears_on_weights(mod["main"])
    kept = {linears[var] for var, keys in linear_modules(mod["main"], linears).items() if set(keys) & keep}

    def quantize(builder: relax.BlockBuilder, x: relax.Expr, w: relax.Expr, n: int, k: int) -> relax.Expr | None:
        if w in kept:
            return bf16_linear(builder, x, w, n, k) if keep_in_bf16 else None
        if not int8.quantizable(n, k, kernel):
            return None
        quantized_count[0] += 1
        emit, op = builder.emit, relax.op
        top = int8.WEIGHT_CODES
        scale = emit(weight_scales(w, n, k, kernel))
        quantized = emit(op.astype(op.clip(op.round(op.divide(w, op.expand_dims(scale, 1))), -top, top), "int8"))
        panel = int8.panel_width(kernel, n, amx_tiles)
        panels = emit(op.permute_dims(
            op.reshape(quantized, (n // panel, panel, k // kernel.group, kernel.group)), [0, 2, 1, 3]))
        column_sum = emit(op.sum(op.astype(quantized, "int32"), axis=1))
        rows = quantize_rows(builder, x, k)
        return builder.emit_te(int8.int8_matmul_te, *(relax.TupleGetItem(rows, i) for i in range(3)),
                               panels, scale, column_sum, primfunc_name_hint=int8.matmul_name(kernel))

    quantized_count = [0]
    return rewrite_linears(mod, linears, quantize)[0], quantized_count[0]



def QuantizeLinearsInt8(target: tvm.target.Target, keep: frozenset[str] = frozenset(),
                        keep_in_bf16: bool = False) -> tvm.transform.Pass:
    """`quantize_linears` as a pass."""
    return as_pass("QuantizeLinearsInt8", lambda mod: quantize_linears(mod, target, keep, keep_in_bf16)[0])


def weight_scales(w: relax.Expr, n: int, k: int, kernel: int8.Int8Kernel) -> relax.Expr:
    """Per output channel of `w` [n, k], the scale of its int8 codes: its largest |w| onto 127 codes, or
    where `kernel` sums pairs of products in int16 (AVX2), its largest sum of a pair's (k = 2i, 2i + 1)
    weights of one sign onto 127. Rounding adds at most one code to a pair, so no pair of codes of one
    sign sums past `int8.PAIR_CODES`, and no code past 127 (a pair's sum bounds each of its weights).
    compile/int8_simulation.py (`weight_scales` there) is the same rule in PyTorch."""
    op = relax.op
    if kernel.int16_pairs:
        pairs, nothing = op.reshape(w, (n, k // 2, 2)), relax.const(0.0, "float32")
        one_sign = op.maximum(op.sum(op.maximum(pairs, nothing), axis=2),
                              op.sum(op.maximum(op.negative(pairs), nothing), axis=2))
        largest = op.max(one_sign, axis=1)
    else:
        largest = op.max(op.abs(w), axis=1)
    codes = relax.const(float(int8.WEIGHT_CODES), "float32")
    return op.divide(op.maximum(largest, relax.const(1e-30, "float32")), codes)


def quantize_rows(builder: relax.BlockBuilder, x: relax.Expr, k: int) -> relax.Expr:
    """The row quantizer's call on `x`; where `x` is a smoothing multiply by a constant [k] vector
    (passes/smooth.py), the quantizer of its input with the multiply folded in."""
    bound = builder.lookup_binding(x) if isinstance(x, relax.Var) else None
    if (isinstance(bound, relax.Call) and bound.op == _MULTIPLY and isinstance(bound.args[1], tvm.ir.expr.Constant)
            and [int(d) for d in bound.args[1].ty.shape] == [k]):
        return builder.emit_te(row_quantize.quantize_rows_te, bound.args[0], bound.args[1],
                               primfunc_name_hint=row_quantize.SMOOTHED_ROW_QUANTIZE)
    return builder.emit_te(row_quantize.quantize_rows_te, x, primfunc_name_hint=row_quantize.ROW_QUANTIZE)


def sentence_rows(tokenizer_file: Path, max_seq: int) -> tuple[np.ndarray, ...]:
    """The shipped sentences as padded rows: ids, attention mask, token type ids, positions."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.enable_padding()
    tokenizer.enable_truncation(max_seq)
    encodings = tokenizer.encode_batch(ACCURACY_SENTENCES)
    ids = np.array([e.ids for e in encodings], dtype=np.int64)
    mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
    positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape).copy()
    return ids, mask, np.zeros_like(ids), positions


def embedding_agreement(quantized: np.ndarray, reference: np.ndarray,
                        sentences: list[str] = ACCURACY_SENTENCES) -> dict:
    """Cosine similarity of each quantized embedding to the fp32 model's: min and mean, and the
    sentence (of `sentences`, the rows' texts) with the least."""
    cosine = np.sum(quantized * reference, axis=1) / (
        np.linalg.norm(quantized, axis=1) * np.linalg.norm(reference, axis=1))
    return {"cosine_min": float(cosine.min()), "cosine_mean": float(cosine.mean()),
            "worst_sentence": sentences[int(cosine.argmin())]}


def classifier_agreement(quantized: np.ndarray, reference: np.ndarray) -> dict:
    """How often the top label is the fp32 model's, and the largest probability difference: over a
    softmax of the labels, or for one logit (a cross-encoder) its sigmoid, the top label then
    being which side of 0.5 the score falls."""
    def probabilities(logits):
        if logits.shape[1] == 1:
            positive = 1 / (1 + np.exp(-logits))
            return np.concatenate([1 - positive, positive], axis=1)
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)

    ours, theirs = probabilities(quantized), probabilities(reference)
    return {"top1_agreement": float(np.mean(ours.argmax(axis=1) == theirs.argmax(axis=1))),
            "max_probability_diff": float(np.abs(ours - theirs).max())}
