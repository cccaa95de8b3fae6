"""Attention's two products in bf16 (AVX512_BF16 `vdpbf16ps`), for the attention kernel of bf16 models.

The fp32 kernel (attention.py) spends its time in two products per (sequence, head) and tile of
16 queries: scores = K Q^T over the head's dims, and context = P V over the keys. Here both run as
`vdpbf16ps`, 32 multiply-adds into 16 fp32 lanes per instruction (an fp32 FMA does 16), with fp32
accumulation; what is around them stays as the fp32 kernel does it, in fp32: the staging of the
head's keys and values, the bias and mask, the softmax (max, exp, sum) and the normalisation.

Operands are rounded to bf16 (nearest even) once: the staged keys per (sequence, head); the staged
values per (sequence, head), in key pairs `[keys / 2, dims, 2]`; each query tile's scaled queries in
dim pairs `[dims / 2, 16, 2]`; each tile's probabilities in key pairs `[keys / 2, 16, 2]`. So one
broadcast 32-bit pair (two keys' dims, or two keys' probabilities) times one register of pairs is
one instruction. The probabilities are rounded after the exp, the sum that normalises them is taken
in fp32: OpenVINO's bf16 attention rounds the same operands.

Why C: as for the bf16 linears (bf16.py), TVM 0.27's LLVM code generator cannot call
`vdpbf16ps`; the products are C functions (c/attention_bf16.c) compiled with the libraries' C compiler,
specialised per head size (16, 32, 64, 128: the register tiles below are compile-time shapes), called from the TIR
kernel with `call_extern`.
"""

from __future__ import annotations

from .bf16 import ISA
from .objects import CObject

HEAD_SIZES = (16, 32, 64, 128)  # head sizes the products are compiled for
LANES = 16  # queries per tile: one zmm of fp32
SCORES = "bert_bf16_attention_scores_d{head}"
CONTEXT = "bert_bf16_attention_context_d{head}"
ROUND = "bert_bf16_round"
PAIR_ROWS = "bert_bf16_pair_rows"
QUERY_PAIRS = "bert_bf16_query_pairs"
SOFTMAX_PAIRS = "bert_bf16_softmax_pairs"

# The softmax's exp (c/exp.h): its argument's floor, the constants of its range reduction and its
# polynomial's coefficients (highest power first), given to the C as macros.
EXP_FLOOR, EXP_LOG2E, EXP_LN2 = -87.0, 1.44269504088896341, 0.693147180559945
EXP_POLYNOMIAL = (0.16566843, 0.50496332, 1.00016419, 0.99992807)
EXP_MACROS = {"BERT_EXP_FLOOR": EXP_FLOOR, "BERT_EXP_LOG2E": EXP_LOG2E, "BERT_EXP_LN2": EXP_LN2,
               **{f"BERT_EXP_P{3 - i}": c for i, c in enumerate(EXP_POLYNOMIAL)}}

# The products, the softmax and the rounding (c/attention_bf16.c), built for the bf16 linears' instruction sets
OBJECT = CObject("attention_bf16.c", frozenset({ROUND, PAIR_ROWS, QUERY_PAIRS, SOFTMAX_PAIRS, *(
    symbol.format(head=head) for symbol in (SCORES, CONTEXT) for head in HEAD_SIZES)}), ISA, tuple(EXP_MACROS.items()))


def supports(head_size: int, lanes: int) -> bool:
    """Whether the bf16 products are compiled for this head size (and the lanes are AVX-512's)."""
    return lanes == LANES and head_size in HEAD_SIZES
