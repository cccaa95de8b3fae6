"""The block-sparse kernel family: y = x @ W^T with W [N, K] stored as BSR (data [nnz, R, C], indices
[nnz] block columns, indptr [N / R + 1] block-row starts), as TVM PR #5377 ran BERT.

CPU: an M-tiled micro-kernel, written scheduled. Each task takes `rows` activation rows, copies
them transposed ([K, rows]: one stored block's column of x is then `rows` contiguous floats), and
streams every block row's stored blocks once for all of them:

    for each block row i, for each stored block j of it, for each column c of the block:
        acc[rows, R] += data[j, :, c] (one vector load) x xt[indices[j] * C + c, :] (rows broadcasts)

so a block loaded from memory feeds `rows` independent accumulators (the untiled kernel re-read
each block for every row of x and chained every block's multiply-add into one accumulator).

CUDA: one thread per output element (a TE compute, scheduled here).
"""

from __future__ import annotations

from tvm import s_tir, te, tirx
from tvm.script import tirx as T

from . import script
from .common import prescheduled

GPU_THREADS = 128


def tile_rows(lanes: int, block_rows: int) -> int:
    """Activation rows per task: rows x R accumulators (in vectors of `lanes`) fill 16 of the 32
    AVX-512 registers, 8 of AVX2's 16 (the rest hold the block and the broadcasts)."""
    vectors = max(1, block_rows // lanes)
    return max(1, (16 if lanes >= 16 else 8) // vectors)


def bsr_matmul_cpu(m, k: int, nnz: int, block: tuple[int, int], block_count: int, dtype: str,
                   lanes: int) -> tirx.PrimFunc:
    """y[M, N / R, R] for `block_count` block rows; `m` an int or a symbolic int64 var."""
    i64 = lambda value: tirx.IntImm("int64", value)  # noqa: E731
    R, C = (i64(v) for v in block)
    K, NNZ, NB = i64(k), i64(nnz), i64(block_count)
    M = i64(m) if isinstance(m, int) else m
    ROWS = i64(tile_rows(lanes, block[0]))
    zero = tirx.const(0.0, dtype)

    @script.prim_func(s_tir=True, private=True)  # the module's only public function is `main`
    def bsr_matmul(x: T.Buffer((M, K), dtype), data: T.Buffer((NNZ, R, C), dtype),
                   indices: T.Buffer((NNZ,), "int32"), indptr: T.Buffer((NB + i64(1),), "int32"),
                   out: T.Buffer((M, NB, R), dtype)):
        T.func_attr({"tirx.noalias": True})
        for tile in T.parallel((M + ROWS - i64(1)) // ROWS):
            columns = T.alloc_buffer((K, ROWS), dtype)
            for kk, row in T.grid(K, ROWS):
                columns[kk, row] = T.if_then_else(tile * ROWS + row < M,
                                                  x[T.min(tile * ROWS + row, M - i64(1)), kk], zero)
            for block_row in T.serial(NB):
                acc = T.alloc_buffer((ROWS, R), dtype, scope="local")
                for row in T.unroll(ROWS):
                    for r in T.vectorized(R):
                        acc[row, r] = zero
                for stored in T.serial(T.Cast("int64", indptr[block_row + i64(1)] - indptr[block_row])):
                    j = T.Cast("int64", indptr[block_row]) + stored
                    for c in T.serial(C):
                        for row in T.unroll(ROWS):
                            for r in T.vectorized(R):
                                acc[row, r] = acc[row, r] + data[j, r, c] * columns[
                                    T.Cast("int64", indices[j]) * C + c, row]
                for row in T.serial(ROWS):
                    if tile * ROWS + row < M:
                        for r in T.vectorized(R):
                            out[tile * ROWS + row, block_row, r] = acc[row, r]

    return prescheduled(bsr_matmul)


def bsr_matmul_te(x: te.Tensor, data: te.Tensor, indices: te.Tensor, indptr: te.Tensor) -> te.Tensor:
    """y[M, N/R, R] = x[M, K] @ W^T with W [N, K] in BSR (the CUDA kernel's compute); the reduction
    over a block row's blocks has a data-dependent extent (indptr[i + 1] - indptr[i])."""
    _, rows, cols = data.shape
    block_rows = indptr.shape[0] - 1

    def compute(m, i, r):
        start = indptr[i]
        nnz = te.reduce_axis((0, indptr[i + 1] - start), name="nnz")
        c = te.reduce_axis((0, cols), name="c")
        j = start + nnz
        return te.sum(data[j, r, c] * x[m, indices[j] * cols + c], axis=[nnz, c])

    return te.compute((x.shape[0], block_rows, rows), compute, name="bsr_matmul")


def bsr_matmul_gpu(m, k: int, nnz: int, block: tuple[int, int], block_count: int, dtype: str) -> tirx.PrimFunc:
    """One thread per output element; consecutive threads cover a block's R rows (coalesced data reads)."""
    x = te.placeholder((m, k), dtype, name="x")
    data = te.placeholder((nnz, *block), dtype, name="data")
    indices = te.placeholder((nnz,), "int32", name="indices")
    indptr = te.placeholder((block_count + 1,), "int32", name="indptr")
    sch = s_tir.Schedule(te.create_prim_func([x, data, indices, indptr, bsr_matmul_te(x, data, indices, indptr)]))
    loop_m, loop_i, loop_r, _ = sch.get_loops(sch.get_sblock("bsr_matmul_l1"))
    bx, tx = sch.split(sch.fuse(loop_m, loop_i, loop_r), [None, GPU_THREADS])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    return prescheduled(sch.mod["main"].without_attr("global_symbol"))
