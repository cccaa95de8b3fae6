"""Attention's two products in int8, for int8 libraries: `vpmaddubsw` + `vpmaddwd` on ymm (AVX2)
or zmm (AVX512BW), `vpdpbusd` on zmm where the CPU has AVX512_VNNI.

The fp32 kernel (attention.py) spends about 80% of its time in two products per (sequence, head)
and tile of 16 queries: scores = K Q^T over the head's dims, and context = P V over the keys.
Here both run as u8 x s8 products summed in int32, four multiply-adds per lane: at AVX2 three
instructions per 32 of them, where fp32 FMAs take four; with VNNI one per 64, where they take
four. The bias, the softmax's max and exp, and the normalisation stay in fp32.

The operands, each quantized once, as the int8 linears' are (kernels/int8.py):
- the tile's scaled queries per query, symmetric onto -127..127 and offset by 128 into u8 (the
  operand that must be unsigned), in dim quads `[dims / 4][16][4]`: one ymm is 8 queries' quads,
  one zmm 16. The offset's share, 128 x the key's sum of codes, starts each key's accumulator;
- the keys per key, s8, scaled so that no pair of same-sign codes in a quad sums past 128 (pairs
  of products are summed in saturating int16: `int8.PAIR_CODES`), broadcast one quad at a time;
- the probabilities exp(s - max) in [0, 1] onto 0..255 (a fixed step of 1/255: the largest is 1),
  in key quads per query `[keys / 4][16]` 32-bit words, broadcast against
- the values per head dim, s8 pair-bounded over the keys, in key quads `[keys / 4][dims][4]`.
Each query's context is divided by its sum of probability codes, the same rounded weights as the
product's. Accuracy: MiniLM's x86-64-v3 int8 library keeps least cosine 0.9922 to fp32 over the
shipped sentences, where with fp32 products it kept 0.9941, under the 0.99 gate the int8 plan
simulates it against (int8_simulation.Simulation).

Every instruction set computes the same codes and sums them exactly, so one simulation serves
all. On zmm the scores take 16 keys a block and the context 16 accumulators: `vpdpbusd`'s 5-cycle
latency wants at least 10 independent chains. With znver4's code on an AMX Xeon the zmm kernel
took 0.62-0.68x the fp32 kernel's time at MiniLM's and bert-base's heads (the compile's timing,
one sequence of 128 and of 512 tokens), and MiniLM's library kept least cosine 0.9943 on the
shipped sentences (0.9944 with fp32 products). The AVX-VNNI level (`--mcpu alderlake`) keeps the
ymm `vpmaddubsw` kernel: `vpdpbusd` in its place was no faster (4 accumulator chains there).

Why C (c/attention_int8.c): the quads, the broadcast words and the saturating pairs are one intrinsic
each there; the products are specialised per head size (16, 32, 64, 128) and called from the TIR kernel with
`call_extern`, as the bf16 products are (attention_bf16.py).
"""

from __future__ import annotations

import math
from pathlib import Path

from . import int8
from .attention_bf16 import EXP_MACROS
from .int8 import PAIR_CODES, WEIGHT_CODES
from .objects import CObject

HEAD_SIZES = (16, 32, 64, 128)  # head sizes the products are compiled for (the staging takes multiples of 16)
LANES = (8, 16)  # fp32 / int32 lanes of a ymm (AVX2) or a zmm (AVX512BW) register
QUERIES = 16  # queries per tile: two ymm registers, one zmm
KEY_STEP = 4  # keys are staged (zero past the last) to whole quads
TILE = "bert_int8_attention_d{head}"
STAGE_KEYS = "bert_int8_stage_keys"
STAGE_VALUES = "bert_int8_stage_values"
QUERY_QUADS = "bert_int8_query_quads"
PROBABILITY_CODES = 255  # exp(s - max) in [0, 1] onto u8
QUERY_OFFSET = 128  # a query code's offset into u8

SYMBOLS = frozenset({STAGE_KEYS, STAGE_VALUES, QUERY_QUADS, *(TILE.format(head=head) for head in HEAD_SIZES)})
_MACROS = {**EXP_MACROS, "BERT_PAIR_CODES": PAIR_CODES, "BERT_CODES": WEIGHT_CODES,
           "BERT_LOG_PROBABILITY_CODES": math.log(PROBABILITY_CODES), "BERT_QUERY_OFFSET": QUERY_OFFSET}


def supports(head_size: int, lanes: int) -> bool:
    """Whether the int8 products are compiled for this head size and vector width (AVX2's ymm or
    AVX-512's zmm)."""
    return lanes in LANES and head_size in HEAD_SIZES


def c_object(kernel: int8.Int8Kernel) -> CObject:
    """The products and their staging (c/attention_int8.c) for the CPUs of an int8 linear `kernel`: zmm tiles
    where it has AVX512BW (with `vpdpbusd` where VNNI), else ymm. Without -fno-tree-coalesce-vars GCC 12
    copies each accumulator to a fresh register every step of the ymm products' loops, and spills two of them."""
    isa = {int8.VNNI: ("-mavx512f", "-mavx512bw", "-mavx512vnni"),
           int8.AVX512BW: ("-mavx512f", "-mavx512bw")}.get(kernel, ("-mavx2",))
    return CObject("attention_int8.c", SYMBOLS, (*isa, "-mfma", "-fno-tree-coalesce-vars"),
                   (*_MACROS.items(), ("BERT_LANES", kernel.lanes)), variant=kernel.name)


def kernels_object(kernel: int8.Int8Kernel) -> Path:
    """`c_object(kernel)` compiled once per process to an object file the libraries link."""
    return c_object(kernel).build()
