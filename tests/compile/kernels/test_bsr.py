"""compile/kernels/bsr.py and compile/sparse_choice.py: the block-sparse micro-kernels at each storage and
block shape against numpy, and each weight's choice between dense and sparse under given times and errors."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from compile.build import make_target
from compile.kernels import bsr
from compile.passes.sparsity import prune_blocks
from compile.sparse_choice import DENSE, TIR, SparseChoice, candidates, choose, simulated_errors, untimed
from tests.support.tvm_run import build_kernel, skip_unless_runs_here

V3, V4 = make_target("cpu", mcpu="x86-64-v3"), make_target("cpu", mcpu="x86-64-v4")
VNNI = make_target("cpu", mcpu="cascadelake")


def _weight(n: int, k: int, block: tuple[int, int], seed: int = 0) -> np.ndarray:
    """A weight at 20% block density whose first block row is empty (an empty row of BSR)."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((n, k)).astype(np.float32)
    weight[:block[0]] = 0
    return prune_blocks(weight, 0.2, block)


def _run(storage: str, weight: np.ndarray, block: tuple[int, int], target, rows: list[int], constant: bool = False):
    """The kernel built once (symbolic M; `constant`: for the one count of `rows`) for `target`, run on each
    count of `rows`: [(x, out)]."""
    lanes = 16 if target is not V3 else 8
    n, k = weight.shape
    arrays = bsr.pack(storage, weight, block)
    m = rows[0] if constant else tvm.tirx.Var("m", "int64")
    lib = build_kernel(bsr.bsr_kernel(storage, m, k, n, arrays, block, lanes).with_attr("global_symbol", "main"),
                       target)
    skip_unless_runs_here(target)
    rng, results = np.random.default_rng(1), []
    for m in rows:
        x = rng.standard_normal((m, k)).astype(np.float32)
        out = tvm.runtime.tensor(np.zeros((m, n), np.float32))
        lib["main"](tvm.runtime.tensor(x), *(tvm.runtime.tensor(a) for a in arrays.values()), out)
        results.append((x, out.numpy()))
    return results


@pytest.mark.parametrize("storage,target,block", [
    ("f32", V4, (16, 1)), ("bf16w", V4, (16, 1)), ("i8w", V4, (16, 1)),  # one zmm per block column
    ("f32", V4, (32, 1)), ("i8w", V4, (16, 4)),  # two zmm; four columns
    ("f32", V3, (8, 1)), ("bf16w", V3, (16, 1)), ("i8w", V3, (32, 1)),  # one, two and four ymm
], ids=lambda value: value if isinstance(value, str) else "x".join(map(str, value)) if isinstance(value, tuple)
    else "v3" if value is V3 else "v4")
def test_fma_kernels_compute_the_stored_weights_product(storage, target, block):
    """Each storage multiplies by its rounding of W (bf16, or int8 codes times per-row scales) in fp32: M of
    one row, a quarter tile, a tile and a tail, an odd count."""
    weight = _weight(96, 40, block)
    tile = bsr.tile_rows(storage, block, 16 if target is V4 else 8)
    for x, out in _run(storage, weight, block, target, [1, tile // 4 or 1, tile, tile + 1, 37]):
        np.testing.assert_allclose(out, x @ bsr.stored_weight(storage, weight).T, rtol=1e-5, atol=1e-5)


@pytest.mark.requires("avx512_vnni")
@pytest.mark.parametrize("storage,block", [("vnni", (16, 1)), ("vnni", (16, 4)), ("vnni_gather", (16, 1))],
                         ids=["vnni-16x1", "vnni-16x4", "vnni_gather-16x1"])
def test_vnni_kernels_match_per_row_u8_activations(storage, block):
    """vpdpbusd on 16 x 4 blocks (a 16 x 1 weight regrouped), or on 16 x 1 blocks in fours of any k: the
    product of the rows as u8 codes with a zero point (taken out exactly with the rows' code sums) and the
    int8 weights. 20% density leaves block rows whose count is no multiple of four (padded fours)."""
    from compile.sparse_choice import _rows_u8

    weight = _weight(64, 48, block)
    for x, out in _run(storage, weight, block, VNNI, [1, 16, 19]):
        want = _rows_u8(x.astype(np.float64)) @ bsr.stored_weight(storage, weight).T
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        exact = x @ weight.T
        assert np.linalg.norm(out - exact) / np.linalg.norm(exact) < 0.02


@pytest.mark.requires("avx512_vnni")
def test_a_constant_row_count_reaches_the_c_routines_intact():
    """A bucket's M is a constant: TVM then counts the loops in int32 and passes their indices so, some of
    them on the stack (the vnni routines take 7 and 15 arguments); the routines read them as int32."""
    weight = _weight(64, 48, (16, 1))
    for storage in ("f32", "vnni", "vnni_gather"):
        ((x, out),) = _run(storage, weight, (16, 1), VNNI, [40], constant=True)
        want = x @ bsr.stored_weight(storage, weight).T
        assert np.abs(out - want).max() <= (1e-5 if storage == "f32" else 0.02) * np.abs(want).max()


def test_candidates_are_the_storages_the_cpu_runs_without_padding():
    """Each storage whose C kernel takes the block as it is, then the TIR kernel, which takes any."""
    assert candidates((96, 40), (16, 1), V4) == [DENSE, "bsr-f32", "bsr-bf16w", "bsr-i8w", TIR]
    assert candidates((96, 40), (16, 1), VNNI)[-2] == "bsr-vnni"  # 16 x 1 blocks regrouped into 16 x 4
    assert candidates((96, 48), (16, 1), VNNI)[-3:] == ["bsr-vnni", "bsr-vnni_gather", TIR]  # K in 16s: fours
    assert "bsr-vnni_gather" not in candidates((96, 48), (16, 4), VNNI)
    assert candidates((96, 40), (8, 1), V4) == [DENSE, TIR]  # half a zmm
    assert candidates((96, 42), (16, 1), VNNI)[-2] == "bsr-i8w"  # K not a multiple of vpdpbusd's 4
    assert untimed(candidates((96, 40), (8, 1), V4)) == TIR and untimed(candidates((96, 40), (16, 1), V4)) == "bsr-f32"


def test_the_gate_admits_what_loses_no_more_than_the_dense_precision():
    weight = _weight(64, 64, (16, 1))
    names = [DENSE, "bsr-f32", "bsr-bf16w", "bsr-i8w", "bsr-vnni", TIR]
    errors = {p: simulated_errors(weight, (16, 1), names, p) for p in ("fp32", "bf16", "int8")}
    fastest_first = {"bsr-vnni": 1.0, "bsr-i8w": 2.0, "bsr-bf16w": 3.0, "bsr-f32": 4.0, TIR: 4.5, DENSE: 5.0}
    assert choose(fastest_first, errors["fp32"]) == "bsr-f32"
    assert choose(fastest_first, errors["bf16"]) == "bsr-bf16w"
    assert choose(fastest_first, errors["int8"]) == "bsr-vnni"
    assert choose({**fastest_first, DENSE: 0.5}, errors["int8"]) == DENSE


def test_each_weight_is_decided_by_the_injected_times_and_errors():
    """The timer and the accuracy are the choice's inputs: a sparse kernel faster than dense but less
    accurate than the gate allows loses to the next one that holds it, and equal times keep dense."""
    seen = []

    def timer(weight, block, names, precision):
        seen.append((weight.shape, precision))
        return {name: {DENSE: 2.0, "bsr-f32": 1.5, "bsr-bf16w": 1.0, "bsr-i8w": 0.5}.get(name, 3.0) for name in names}

    def accuracy(weight, block, names, precision):
        return {name: {DENSE: 0.01, "bsr-bf16w": 0.005, "bsr-i8w": 0.02}.get(name, 0.0) for name in names}

    choice = SparseChoice((16, 1), 0.5, V4, lambda name: "int8" if name == "w" else "bf16", timer, accuracy)
    decided = choice.decide(_weight(32, 16, (16, 1)), "w")
    assert decided["chosen"] == "bsr-bf16w" and decided["precision"] == "int8"
    assert [(c["name"], c["holds"]) for c in decided["candidates"]] == [
        (DENSE, True), ("bsr-f32", True), ("bsr-bf16w", True), ("bsr-i8w", False), (TIR, True)]
    assert choice.decide(_weight(32, 16, (16, 1)), "w") is decided and len(seen) == 1  # decided once per weight
    tied = SparseChoice((16, 1), 0.5, V4, timer=lambda w, b, names, p: {name: 1.0 for name in names},
                        accuracy=accuracy)
    assert tied.decide(_weight(32, 16, (16, 1)), "v")["chosen"] == DENSE
