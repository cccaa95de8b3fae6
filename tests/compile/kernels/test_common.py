"""compile/kernels/common.py: reads of a zero-padded copy rewritten to read the rows in place (Before/Expected
TIR)."""

from __future__ import annotations

import tvm_ffi
from tvm import tirx
from tvm.script import tirx as T

from compile.kernels.common import read_padded_rows_in_place


@T.macro
def _pad_five_rows_to_eight(x, x_pad):
    for i, k in T.grid(T.int64(8), T.int64(4)):
        with T.sblock("x_pad"):
            vi, vk = T.axis.remap("SS", [i, k])
            x_pad[vi, vk] = T.if_then_else(vi < T.int64(5), x[vi, vk], T.float32(0.0))


@T.prim_func(private=True, s_tir=True)
def _sums_padded_rows(x: T.Buffer((T.int64(5), T.int64(4)), "float32"), y: T.Buffer((T.int64(8),), "float32")):
    x_pad = T.sblock_alloc_buffer((T.int64(8), T.int64(4)))
    _pad_five_rows_to_eight(x, x_pad)
    for i, k in T.grid(T.int64(8), T.int64(4)):
        with T.sblock("row_sum"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                y[vi] = T.float32(0.0)
            y[vi] = y[vi] + x_pad[vi, vk]


@T.prim_func(private=True, s_tir=True)
def _sums_rows_read_clamped(x: T.Buffer((T.int64(5), T.int64(4)), "float32"), y: T.Buffer((T.int64(8),), "float32")):
    for i, k in T.grid(T.int64(8), T.int64(4)):
        with T.sblock("row_sum"):
            vi, vk = T.axis.remap("SR", [i, k])
            with T.init():
                y[vi] = T.float32(0.0)
            y[vi] = y[vi] + x[T.min(vi, T.int64(4)), vk]


@T.prim_func(private=True, s_tir=True)
def _sums_padded_row_pairs(x: T.Buffer((T.int64(5), T.int64(4)), "float32"), y: T.Buffer((T.int64(4),), "float32")):
    x_pad = T.sblock_alloc_buffer((T.int64(8), T.int64(4)))
    _pad_five_rows_to_eight(x, x_pad)
    for i, k in T.grid(T.int64(4), T.int64(4)):
        with T.sblock("pair_sum"):
            vi, vk = T.axis.remap("SR", [i, k])
            T.reads(x_pad[vi * T.int64(2):vi * T.int64(2) + T.int64(2), vk])
            T.writes(y[vi])
            with T.init():
                y[vi] = T.float32(0.0)
            y[vi] = y[vi] + x_pad[vi * T.int64(2), vk] + x_pad[vi * T.int64(2) + T.int64(1), vk]


def _padded_copy(func: tirx.PrimFunc) -> tirx.Buffer:
    (copy,) = func.body.block.alloc_buffers
    return copy


def test_reads_of_a_padded_copy_read_the_rows_clamped():
    """The copy is dropped and each read of it reads x itself, row min(i, M - 1)."""
    rewritten = read_padded_rows_in_place(_sums_padded_rows, _padded_copy(_sums_padded_rows))
    assert tvm_ffi.structural_equal(rewritten, _sums_rows_read_clamped), rewritten.script()


def test_a_reader_of_several_padded_rows_keeps_the_copy():
    """Clamping the first of a block of rows would let the block run past x's end: nothing changes."""
    rewritten = read_padded_rows_in_place(_sums_padded_row_pairs, _padded_copy(_sums_padded_row_pairs))
    assert tvm_ffi.structural_equal(rewritten, _sums_padded_row_pairs)
