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
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from ..checkpoint import CheckpointInfo

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


# Random token ids, measured beside the shipped sentences wherever an embedding's rounded precision is
# (the int8 plan's calibration and gate, the built libraries' check, auto's candidates): ids drawn from
# the whole vocabulary, no special tokens added, as a client or a benchmark may send them. They reach
# activation channels and ranges that real text leaves unvisited: all-mpnet-base-v2's int8 plan, measured
# on the sentences alone, held 0.9993 there and 0.992 on such rows.
RANDOM_ROW_LENGTHS = (8, 32, 128)  # ascending: a model with fewer positions takes those that fit
RANDOM_ROWS_SEED = 0
ACCURACY_ROWS = [*ACCURACY_SENTENCES, *(f"{n} random token ids" for n in RANDOM_ROW_LENGTHS)]


def random_token_rows(vocab_size: int, max_seq: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, attention mask) of RANDOM_ROW_LENGTHS' rows that fit `max_seq`, the same at every compile."""
    lengths = np.array([n for n in RANDOM_ROW_LENGTHS if n <= max_seq], dtype=np.int64)
    width = int(lengths.max(initial=0))
    ids = np.random.default_rng(RANDOM_ROWS_SEED).integers(0, vocab_size, (len(lengths), width), dtype=np.int64)
    return ids, (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)


def accuracy_rows(info: CheckpointInfo, task: str) -> tuple[np.ndarray, ...]:
    """The rows a rounded precision is measured on (`sentence_rows`' four inputs): the shipped sentences,
    and for embeddings `random_token_rows` after them (`ACCURACY_ROWS` names them). Random ids have no
    right label for a classifier's top-1 agreement to keep: its rows are the sentences'."""
    sentences = sentence_rows(info.tokenizer_file, info.max_seq)
    if task == "classify":
        return sentences
    ids, mask = random_token_rows(int(info.config["vocab_size"]), info.max_seq)
    width = max(sentences[0].shape[1], ids.shape[1])

    def padded(x: np.ndarray) -> np.ndarray:
        return np.pad(x, ((0, 0), (0, width - x.shape[1])))

    ids, mask = (np.concatenate([padded(a), padded(b)]) for a, b in ((sentences[0], ids), (sentences[1], mask)))
    positions = np.broadcast_to(np.arange(width, dtype=np.int64), ids.shape).copy()
    return ids, mask, np.zeros_like(ids), positions


def embedding_agreement(quantized: np.ndarray, reference: np.ndarray, sentences: list[str] = ACCURACY_ROWS) -> dict:
    """Cosine similarity of each quantized embedding to the fp32 model's: min and mean, and the
    sentence (of `sentences`, the rows' texts: the shipped sentences, then the random rows) with the least."""
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
