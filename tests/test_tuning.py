"""`--tune`: MetaSchedule per padded bucket, a tuned kernel shipped only where it beat the hand
schedule; the kept schedules replace the hand ones in the build (`apply_tuned`)."""

from __future__ import annotations

import pytest
import tvm
import tvm_ffi
from conftest import compile_artifact
from tvm import s_tir, te
from tvm.s_tir import meta_schedule as ms

from artifact.manifest import Manifest
from compile.build import make_target
from compile.config import CompileConfig
from compile.kernels.common import SCHEDULED_ATTR
from compile.schedule import apply_tuned, tuning_workload
from compile.tuning import KEEP_MARGIN, keeps

pytestmark = pytest.mark.slow  # collected first: see conftest.py


def _scale_kernel(n: int = 64):
    x = te.placeholder((n, n), "float32", name="x")
    y = te.compute((n, n), lambda i, j: x[i, j] * 2.0, name="y")
    return te.create_prim_func([x, y]).with_attr("global_symbol", "scale")


def _add_kernel(n: int = 64):
    x = te.placeholder((n, n), "float32", name="x")
    y = te.compute((n, n), lambda i, j: x[i, j] + 1.0, name="y")
    return te.create_prim_func([x, y]).with_attr("global_symbol", "add_one")


def test_apply_tuned_replaces_exactly_the_kernels_the_database_holds():
    target = make_target("cpu")
    scale, add = _scale_kernel(), _add_kernel()
    workload = tuning_workload(scale)
    sch = s_tir.Schedule(workload)
    i, _ = sch.get_loops(sch.get_sblock("y"))
    sch.parallel(i)
    database = ms.database.MemoryDatabase()
    database.commit_tuning_record(ms.database.TuningRecord(
        sch.trace, database.commit_workload(workload), [1e-6], target, ms.arg_info.ArgInfo.from_prim_func(scale)))
    before = tvm.IRModule({"scale": scale, "add_one": add})
    after = apply_tuned(database, target)(before)
    assert after["scale"].attrs[SCHEDULED_ATTR]
    assert tvm_ffi.structural_equal(after["scale"].body, sch.mod["main"].body)
    assert not tvm_ffi.structural_equal(after["scale"].body, scale.body)  # the tuned loop nest, not the original
    assert tvm_ffi.structural_equal(after["add_one"], add)  # no record: left for the hand schedule


def test_a_tuned_kernel_ships_only_when_faster_by_the_margin():
    assert keeps(1.0, 0.9) and not keeps(1.0, 1.0 - KEEP_MARGIN / 2) and not keeps(1.0, None)


def test_tune_is_refused_where_shapes_are_not_constant():
    with pytest.raises(ValueError, match="layout padded only"):
        CompileConfig(layout="packed", tune=10)


def test_tuned_compile_reports_every_tuned_kernel_and_validates(tiny_bert_dir, tmp_path):
    """A one-second budget still tunes the bucket's slowest kernel (one round of trials): the
    manifest records its hand and tuned times, ships it only where it won, and the library
    (hand or tuned kernels) matches PyTorch as every library must."""
    out = tmp_path / "tuned"
    compile_artifact(tiny_bert_dir, out, ["2x16"], tune=1.0, generic_shapes=["3x5"])
    manifest = Manifest.read(out)
    tuning = manifest.tuning
    assert tuning is not None and tuning.seconds_per_bucket == 1.0
    assert [k.library for k in tuning.kernels] == ["bucket_2x16"] and tuning.kernels[0].trials >= 8
    for kernel in tuning.kernels:
        assert kernel.kept == keeps(kernel.hand_ms, kernel.tuned_ms)
    assert (tuning.database is not None) == any(k.kept for k in tuning.kernels)
    assert (out / "tuning").is_dir() == any(k.kept for k in tuning.kernels)
    assert manifest.validated and manifest.buckets[0].max_abs_diff < 1e-4  # against PyTorch
